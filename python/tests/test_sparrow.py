"""The Python package against the `sparrow` command: same summaries, same
predictions, the CLI's errors as exceptions, the GIL released, Ctrl-C saving
the model."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import sparrow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "reference-mlp.toml"
CRITEO_NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


@pytest.fixture(scope="session")
def sparrow_bin():
    """The `sparrow` binary of this checkout (built if missing)."""
    path = Path(os.environ.get("SPARROW_BIN", REPO / "target" / "release" / "sparrow"))
    if "SPARROW_BIN" not in os.environ:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "sparrow"], cwd=REPO, check=True)
    assert path.is_file(), f"no sparrow binary at {path}"
    return path


@pytest.fixture(scope="session")
def cli(sparrow_bin):
    path = sparrow_bin

    def run(*args):
        done = subprocess.run([str(path), *map(str, args)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen")
    truth = sparrow.gen(out, train_rows=20_000, test_rows=3_000, seed=7)
    assert truth["train_rows"] == 20_000 and truth["test_rows"] == 3_000
    assert (out / "train.tsv").is_file() and (out / "truth.json").is_file()
    return out


def overrides(data, ckpt):
    return {
        "data.train": str(data / "train.tsv"),
        "data.test": str(data / "test.tsv"),
        "checkpoint.dir": str(ckpt),
    }


@pytest.fixture(scope="session")
def trained(data, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    summary = sparrow.train(CONFIG, progress=False, **overrides(data, ckpt))
    return ckpt, summary


def read_floats(path):
    return np.array([float(line) for line in Path(path).read_text().split()], dtype=np.float32)


def test_train_returns_the_cli_summary(cli, data, trained, tmp_path):
    _, summary = trained
    sets = [a for k, v in overrides(data, tmp_path / "c").items() for a in ("--set", f"{k}={json.dumps(v)}")]
    expected = cli("train", "--config", CONFIG, "--quiet", *sets)
    assert summary.keys() == expected.keys()
    # Same config and seed: the same model, so the same test metrics, bit for bit.
    for key in ("test_auc", "test_logloss", "train_rows", "steps", "embedding_rows", "bayes_auc"):
        assert summary[key] == expected[key], key
    assert summary["test_auc"] > 0.7


def test_bf16_from_python_trains_the_clis_model(cli, data, tmp_path):
    """`model.precision = "bf16"` takes the command's product path from
    Python too (on a CPU with AMX, its tiles: Linux grants them to the
    Python process as well, `faulthandler`'s signal stack and all), so the
    same model, bit for bit."""
    bf16 = {"model.precision": "bf16"}
    summary = sparrow.train(CONFIG, progress=False, **overrides(data, tmp_path / "py"), **bf16)
    sets = {**overrides(data, tmp_path / "cli"), **bf16}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    expected = cli("train", "--config", CONFIG, "--quiet", *args)
    for key in ("test_auc", "test_logloss", "train_logloss"):
        assert summary[key] == expected[key], key


def test_a_dict_config_trains_like_its_file(data, trained, tmp_path):
    _, from_file = trained
    config = {
        "data": {"format": "criteo"},
        "model": {"kind": "mlp", "embedding_dim": 16, "hidden": [256, 128]},
        "train": {"batch_size": 1024, "epochs": 1, "threads": 2, "seed": 1},
        "embedding": {"optimizer": "adagrad", "learning_rate": 0.05, "init": {"kind": "uniform", "scale": 0.01}},
        "dense_optimizer": {"kind": "adam", "learning_rate": 0.001},
    }
    summary = sparrow.train(config, progress=False, **overrides(data, tmp_path / "c"))
    assert summary["test_auc"] == from_file["test_auc"]


def test_predict_equals_the_cli_on_a_file_a_dataframe_and_columns(cli, data, trained, tmp_path):
    pd = pytest.importorskip("pandas")
    ckpt, _ = trained
    cli("predict", "--checkpoint", ckpt, "--data", data / "test.tsv", "--out", tmp_path / "p.txt")
    expected = read_floats(tmp_path / "p.txt")
    model = sparrow.Model.load(ckpt)
    assert model.inputs == CRITEO_NAMES[1:] and model.kind == "mlp" and model.step > 0

    from_file = model.predict(data / "test.tsv")
    assert from_file.dtype == np.float32 and len(from_file) == len(expected) == 3_000
    np.testing.assert_allclose(from_file, expected, rtol=0, atol=1e-6)

    frame = pd.read_csv(
        data / "test.tsv", sep="\t", header=None, names=CRITEO_NAMES, dtype={f"C{i}": str for i in range(1, 27)}
    )
    np.testing.assert_allclose(model.predict(frame), expected, rtol=0, atol=1e-6)

    # A dict of numpy columns; the label is ignored.
    columns = {name: frame[name].to_numpy() for name in CRITEO_NAMES}
    np.testing.assert_allclose(model.predict(columns), expected, rtol=0, atol=1e-6)

    # Missing columns read as empty cells, as in the file.
    rows = data.joinpath("test.tsv").read_text().splitlines()[:50]
    blanked = "\n".join("\t".join(r.split("\t")[:14] + [""] * 26) for r in rows) + "\n"
    (tmp_path / "blank.tsv").write_text(blanked)
    cli("predict", "--checkpoint", ckpt, "--data", tmp_path / "blank.tsv", "--out", tmp_path / "b.txt")
    dense_only = {name: frame[name].to_numpy()[:50] for name in CRITEO_NAMES[1:14]}
    np.testing.assert_allclose(model.predict(dense_only), read_floats(tmp_path / "b.txt"), rtol=0, atol=1e-6)


def test_an_export_predicts_as_the_cli(cli, data, trained, tmp_path):
    ckpt, _ = trained
    cli("export", "--checkpoint", ckpt, "--out", tmp_path / "export")
    cli("predict", "--model", tmp_path / "export", "--data", data / "test.tsv", "--out", tmp_path / "p.txt")
    model = sparrow.Model.load(tmp_path / "export")
    np.testing.assert_allclose(model.predict(data / "test.tsv"), read_floats(tmp_path / "p.txt"), rtol=0, atol=1e-6)


def test_evaluate_equals_the_cli(cli, data, trained):
    ckpt, summary = trained
    got = sparrow.evaluate(ckpt, data / "test.tsv")
    expected = cli("eval", "--checkpoint", ckpt, "--data", data / "test.tsv")
    assert got["auc"] == expected["auc"] == summary["test_auc"]
    assert got["logloss"] == expected["logloss"]


def test_errors_are_exceptions_with_the_cli_messages(data, trained, tmp_path):
    ckpt, _ = trained
    with pytest.raises(sparrow.ConfigError, match="learnin_rate") as e:
        sparrow.train(CONFIG, progress=False, **{"embedding.learnin_rate": 0.1})
    assert isinstance(e.value, ValueError) and "embedding" in str(e.value)
    with pytest.raises(sparrow.FileError, match="nope.toml"):
        sparrow.train(tmp_path / "nope.toml")
    with pytest.raises(sparrow.ArgumentError, match="SECTION.KEY"):
        sparrow.train(CONFIG, learning_rate=0.1)
    with pytest.raises(sparrow.CheckpointError, match="no manifest.json"):
        sparrow.Model.load(tmp_path)
    with pytest.raises(sparrow.SparrowError, match="missing.tsv"):
        sparrow.evaluate(ckpt, tmp_path / "missing.tsv")

    model = sparrow.Model.load(ckpt)
    with pytest.raises(sparrow.DataError, match="`I99`: the model has no such input"):
        model.predict({"I1": np.array([1.0]), "I99": np.array([2.0])})
    with pytest.raises(sparrow.DataError, match="has 1 rows"):
        model.predict({"I1": np.array([1.0, 2.0]), "I2": np.array([1.0])})
    with pytest.raises(sparrow.DataError, match="holds a line break or a tab"):
        model.predict({"C1": ["a\tb"]})
    # A dense value that is not a number: the reader's message, naming the row.
    with pytest.raises(sparrow.DataError, match=r"column `I1`, row 0: `x` is not an integer"):
        model.predict({"I1": ["x"]})
    with pytest.raises(sparrow.DataError, match=r"column `I2`, row 1: `2.5` is not an integer"):
        model.predict({"I2": np.array([1.0, 2.5])})
    with pytest.raises(sparrow.DataError, match=r"column `I3`, row 0: `1000000000000000000` is not an integer"):
        model.predict({"I3": np.array([10**18], dtype=np.int64)})
    assert len(model.predict({"I1": np.array([3.0])})) == 1

    bad = tmp_path / "bad.tsv"
    bad.write_text("clicked\t2\n" * 3)
    with pytest.raises(sparrow.DataError, match="bad.tsv"):
        sparrow.train(CONFIG, progress=False, **{**overrides(data, tmp_path / "c"), "data.train": str(bad)})


def test_training_releases_the_gil_and_reports_progress(data, tmp_path):
    updates = []
    result = {}

    def run():
        result["summary"] = sparrow.train(
            CONFIG,
            progress=updates.append,
            **{**overrides(data, tmp_path / "c"), "train.epochs": 4, "train.log_interval_steps": 5},
        )

    worker = threading.Thread(target=run)
    ticks = 0
    worker.start()
    while worker.is_alive():
        ticks += 1
        time.sleep(0.002)
    worker.join()
    steps = [u["step"] for u in updates]
    assert steps == sorted(steps) and len(steps) >= 10 and steps[0] == 5
    assert updates[-1]["bytes_done"] <= updates[-1]["bytes_total"]
    assert result["summary"]["steps"] == 80 and steps[-1] == 80  # 20 batches an epoch
    # This thread ran all along: with the GIL held for the whole run it
    # would have ticked once or twice.
    assert ticks >= 50, ticks


def test_progress_without_tqdm_prints_plain_lines(data, tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    sparrow.train(CONFIG, **{**overrides(data, tmp_path / "c"), "train.log_interval_steps": 5})
    err = capfd.readouterr().err
    assert "step 5 epoch 0 samples 5120 train_logloss" in err


def test_a_raising_progress_callback_stops_training_with_the_model_saved(data, tmp_path):
    def boom(update):
        raise RuntimeError(f"stop at {update['step']}")

    ckpt = tmp_path / "c"
    with pytest.raises(RuntimeError, match="stop at 2"):
        sparrow.train(CONFIG, progress=boom, **{**overrides(data, ckpt), "train.log_interval_steps": 2})
    assert (ckpt / "LATEST").is_file()
    assert sparrow.Model.load(ckpt).step >= 2


def test_ctrl_c_stops_training_and_saves_the_model(data, tmp_path):
    ckpt = tmp_path / "c"
    script = textwrap.dedent(
        f"""
        import json, signal, sys, sparrow
        # As in a terminal: a shell that starts a job in the background
        # (CI's, say) hands it SIGINT ignored, and Python then keeps it so.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def started(update):
            print("started", flush=True)
        try:
            sparrow.train({str(CONFIG)!r}, progress=started, **{{
                "data.train": {str(data / "train.tsv")!r}, "data.test": {str(data / "test.tsv")!r},
                "checkpoint.dir": {str(ckpt)!r},
                "train.epochs": 1000, "train.log_interval_steps": 1}})
        except KeyboardInterrupt as e:
            print("interrupted:", e, flush=True)
            sys.exit(7)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "started"
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 7, out
    assert "training stopped after step" in out and str(ckpt) in out
    model = sparrow.Model.load(ckpt)
    assert 0 < model.step < 1000 * 20
    # The saved model resumes.
    resumed = sparrow.train(
        CONFIG, progress=False, resume=ckpt, **{**overrides(data, ckpt), "train.epochs": 1000, "train.max_steps": model.step + 3}
    )
    assert resumed["resumed_from_step"] == model.step and resumed["steps"] == model.step + 3


def test_tensorboard_reads_the_runs_scalars(data, tmp_path):
    """`train.tensorboard_dir`: the event file TensorBoard's own reader
    (EventAccumulator, as `tensorboard --logdir` uses) loads, with the curves."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    summary = sparrow.train(
        CONFIG,
        progress=False,
        **{
            **overrides(data, tmp_path / "c"),
            "train.tensorboard_dir": str(board),
            "train.log_interval_steps": 5,
            "train.eval_every_steps": 10,
        },
    )
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/logloss", "train/samples_per_sec", "train/dedup_ratio", "test/auc", "test/logloss",
                "step_ms/lookup", "step_ms/dense", "step_ms/update"):
        assert tag in tags, (tag, tags)
    auc = events.Scalars("test/auc")
    assert [e.step for e in auc] == [10, 20, summary["steps"]]
    assert abs(auc[-1].value - summary["test_auc"]) < 1e-6
    loss = events.Scalars("train/logloss")
    assert [e.step for e in loss] == list(range(5, summary["steps"] + 1, 5))


def test_a_csv_model_predicts_a_dataframe_as_the_cli(cli, tmp_path):
    pd = pytest.importorskip("pandas")
    data = tmp_path / "days"
    sparrow.gen(data, train_rows=6_000, test_rows=1_000, format="csv", days=2)
    names = [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]
    config = {
        "data": {
            "format": "csv",
            "train": str(data / "train.csv"),
            "test": str(data / "test.csv"),
            "schema": {"label": "label", "dense": names[0], "sparse": names[1], "dense_transform": "log1p",
                       "timestamp": "ts"},
        },
        "model": {"kind": "mlp", "embedding_dim": 8, "hidden": [16]},
        "train": {"batch_size": 256},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    cli("predict", "--checkpoint", tmp_path / "ck", "--data", data / "test.csv", "--out", tmp_path / "p.txt")
    expected = read_floats(tmp_path / "p.txt")
    model = sparrow.Model.load(tmp_path / "ck")
    assert model.format == "csv" and model.inputs == names[0] + names[1]
    frame = pd.read_csv(data / "test.csv", dtype={c: str for c in names[1]}, keep_default_na=False)
    np.testing.assert_allclose(model.predict(frame), expected, rtol=0, atol=1e-6)
    # Without the time column (serving needs none), and with a value that
    # holds the delimiter and a quote: it is quoted, as the CSV reader reads it.
    frame = frame.drop(columns=["ts"])
    np.testing.assert_allclose(model.predict(frame), expected, rtol=0, atol=1e-6)
    odd = frame.head(3).copy()
    odd["C1"] = ['a,b', 'say "hi"', ""]
    assert len(model.predict(odd)) == 3


def test_the_books_python_example_runs(tmp_path):
    """The book's Python chapter's notebook-style example, as a new user would
    paste it (in a scratch directory, on fewer rows)."""
    section = (REPO / "docs" / "book" / "src" / "python.md").read_text()
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[: code.index("```")]
    code = code.replace("train_rows=200_000, test_rows=20_000", "train_rows=20_000, test_rows=2_000")
    code = code.replace('"configs/', '"' + str(REPO / "configs") + "/")
    assert "sparrow.Model.load" in code and "model.predict(df)" in code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "data" / "ckpt" / "LATEST").is_file()


def test_a_triton_client_gets_predicts_figures_from_sparrow_serve(sparrow_bin, cli, data, trained, tmp_path):
    """KServe v2 through Triton's own HTTP client (tritonclient), unchanged:
    JSON tensors and its binary tensor extension, NaN as a missing count."""
    import tritonclient.http as triton

    ckpt, _ = trained
    cli("export", "--checkpoint", ckpt, "--out", tmp_path / "ctr")
    cli("predict", "--model", tmp_path / "ctr", "--data", data / "test.tsv", "--out", tmp_path / "p.txt")
    expected = read_floats(tmp_path / "p.txt")[:64]
    server = subprocess.Popen(
        [str(sparrow_bin), "serve", "--model", str(tmp_path / "ctr"), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        url = json.loads(server.stdout.readline())["listening"]
        client = triton.InferenceServerClient(url)
        assert client.is_server_live() and client.is_model_ready("ctr")
        meta = client.get_model_metadata("ctr")
        assert [i["name"] for i in meta["inputs"]] == CRITEO_NAMES[1:]
        rows = [line.split("\t") for line in (data / "test.tsv").read_text().splitlines()[:64]]
        for binary in (False, True):
            inputs = []
            for i, name in enumerate(CRITEO_NAMES[1:]):
                cells = [r[1 + i] if 1 + i < len(r) else "" for r in rows]
                if i < 13:
                    column = np.array([float(c) if c else np.nan for c in cells], dtype=np.float32)
                    tensor = triton.InferInput(name, [len(rows)], "FP32")
                else:
                    column = np.array(cells, dtype=object)
                    tensor = triton.InferInput(name, [len(rows)], "BYTES")
                tensor.set_data_from_numpy(column, binary_data=binary)
                inputs.append(tensor)
            output = triton.InferRequestedOutput("probability", binary_data=binary)
            got = client.infer("ctr", inputs, outputs=[output]).as_numpy("probability")
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0


def test_progress_draws_a_tqdm_bar_when_tqdm_is_installed(data, tmp_path, capfd):
    pytest.importorskip("tqdm")
    sparrow.train(CONFIG, **{**overrides(data, tmp_path / "c"), "train.log_interval_steps": 5})
    err = capfd.readouterr().err
    assert "train:" in err and "step=20" in err and "train_logloss" not in err, err[-500:]


def test_predict_writes_no_file(trained, tmp_path, monkeypatch):
    """Rows given as columns go straight into batches: no file is written,
    so none can be planted (a symlink where the old predictable name
    `sparrow-predict-PID-N.txt` was truncated another file) and none is
    left behind."""
    ckpt, _ = trained
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for n in range(8):
        os.symlink(victim, shared / f"sparrow-predict-{os.getpid()}-{n}.txt")
    before = sorted(p.name for p in shared.iterdir())
    monkeypatch.setenv("TMPDIR", str(shared))
    model = sparrow.Model.load(ckpt)
    assert len(model.predict({"I1": np.arange(10.0), "C1": ["a"] * 10})) == 10
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in shared.iterdir()) == before


def test_an_override_key_must_be_a_dotted_name(trained):
    ckpt, _ = trained
    for key in ["train.seed=1\n[evil]\nx", "train.se ed", "train.[seed]", "train"]:
        with pytest.raises(sparrow.ArgumentError, match="SECTION.KEY"):
            sparrow.Model.load(ckpt, **{key: 5})


def test_an_object_cell_is_refused_naming_its_column_and_row(trained):
    """A cell holding an arbitrary object would be read as its repr, whose
    memory address changes run to run; numbers, strings, bytes and None are
    values."""
    ckpt, _ = trained
    model = sparrow.Model.load(ckpt)
    cells = np.array(["a", object(), "c"], dtype=object)
    with pytest.raises(sparrow.DataError, match=r"column `C1`, row 1: a object is not a value"):
        model.predict({"C1": cells})
    mixed = np.array(["a", 7, None, b"b", 2.5, np.int64(3)], dtype=object)
    assert len(model.predict({"C1": mixed})) == 6


def test_ctrl_c_interrupts_predict_between_chunks(trained, tmp_path):
    """SIGINT while a million rows are scored stops predict after the chunk
    in progress (KeyboardInterrupt), not once every row is scored. The
    signal is sent when the first chunk's "scored" record reaches Python's
    logging, so the order is set by that event, not by time."""
    ckpt, _ = trained
    script = textwrap.dedent(
        f"""
        import json, logging, os, signal, sys
        import numpy as np, sparrow
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see above)
        scored = []
        class Interrupt(logging.Handler):
            def emit(self, record):
                scored.append(record.getMessage())
                if len(scored) == 1:
                    os.kill(os.getpid(), signal.SIGINT)
        log = logging.getLogger("sparrow.predict")
        log.setLevel(logging.DEBUG)
        log.addHandler(Interrupt())
        model = sparrow.Model.load({str(ckpt)!r})
        try:
            model.predict({{"I1": np.arange(1_000_000) % 100}})
            print(json.dumps({{"finished": scored}}), flush=True)
        except KeyboardInterrupt:
            print(json.dumps({{"scored": scored}}), flush=True)
            sys.exit(7)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 7, done.stdout + done.stderr
    scored = json.loads(done.stdout.strip().splitlines()[-1])["scored"]
    assert scored == ["scored rows 0..65536 of 1000000"], scored


def test_a_crafted_export_is_an_error_not_a_panic(cli, trained, tmp_path):
    """An export whose embeddings.bin claims 2**61 more rows than it holds
    (the count that wraps an unchecked size back to the true one), with its
    checksum corrected: `Model.load` raises CheckpointError, which `except
    Exception` catches (it raised pyo3's PanicException, which it does not)."""
    import xxhash

    ckpt, _ = trained
    export = tmp_path / "export"
    cli("export", "--checkpoint", ckpt, "--out", export)
    rows = bytearray((export / "embeddings.bin").read_bytes())
    dim = int.from_bytes(rows[8:12], "little")
    count = int.from_bytes(rows[12:20], "little")
    record = 8 + 4 * dim
    shift = 64 - ((record & -record).bit_length() - 1)
    rows[12:20] = ((count + (1 << shift)) % (1 << 64)).to_bytes(8, "little")
    (export / "embeddings.bin").write_bytes(bytes(rows))
    manifest = json.loads((export / "manifest.json").read_text())
    manifest["files"]["embeddings.bin"]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(rows))
    (export / "manifest.json").write_text(json.dumps(manifest))
    try:
        sparrow.Model.load(export)
    except Exception as e:  # noqa: BLE001 - the point: an ordinary exception
        assert isinstance(e, sparrow.CheckpointError) and "embeddings.bin" in str(e), e
    else:
        raise AssertionError("a crafted export loaded")


def test_an_online_run_reports_the_lag_and_the_windowed_auc(cli, data, tmp_path):
    """The book's online example (the Python chapter): `sparrow.train` on a Kafka topic (a real
    broker, tansu, as the Rust stream tests start it), the progress callback
    reading the lag and the windowed AUC."""
    home = Path(os.environ.get("HOME", "/root"))
    tansu = os.environ.get("SPARROW_TANSU", str(home / ".cache" / "sparrow-tools" / "tansu-0.6.0" / "bin" / "tansu"))
    assert Path(tansu).is_file(), "the stream tests need tansu: run ./scripts/ensure-tansu (./scripts/test does)"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen(
        [tansu, "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in broker.stdout:
            if "ready in" in line:
                break
        rows = tmp_path / "rows.tsv"
        rows.write_text("".join((data / "train.tsv").read_text().splitlines(keepends=True)[:3000]))
        addr = f"127.0.0.1:{port}"
        produced = cli("produce", "--brokers", addr, "--topic", "py", "--partitions", 2, "--from", rows)
        assert produced["records"] == 3000
        updates = []
        summary = sparrow.train(
            CONFIG,
            progress=updates.append,
            **{
                "data.test": str(data / "test.tsv"),
                "checkpoint.dir": str(tmp_path / "online"),
                "data.stream.topic": "py",
                "data.stream.brokers": [addr],
                "data.stream.stop_when_idle_secs": 1,
                "train.log_interval_steps": 2,
            },
        )
    finally:
        broker.kill()
        broker.wait()
    assert summary["stream_records"] == 3000 and summary["online_samples"] == 3000
    assert summary["stream_offsets"] == {"0": 1500, "1": 1500}
    assert updates and all(u["stream_lag_records"] is not None for u in updates)
    assert updates[-1]["stream_lag_secs"] >= 0
    aucs = [u["online_window_auc"] for u in updates if u["online_window_auc"] is not None]
    assert aucs and all(0.0 < a < 1.0 for a in aucs)


def test_several_tasks_predict_a_column_each_and_take_list_columns(cli, tmp_path):
    """A DIN model of three tasks (two binary, one of three classes) on
    `gen --tasks --sequence`: `Model.predict` returns a column per task,
    equal to `sparrow predict`'s, from a file, a DataFrame whose history
    column holds a list of IDs a row, or a dict of lists."""
    pd = pytest.importorskip("pandas")
    data = tmp_path / "behaviour"
    cli("gen", "--out", data, "--train-rows", "4000", "--test-rows", "300", "--tasks", "--sequence",
        "--classes", "3")
    ids = ["user_id", "item_id", "item_category", "site"]
    config = {
        "data": {
            "format": "csv",
            "train": str(data / "train.csv"),
            "test": str(data / "test.csv"),
            "schema": {"labels": ["click", "conversion", "ad_type"], "sparse": ids, "dense": ["price"],
                       "multi_hot_separator": "|",
                       "sequence": [{"field": "hist_items", "table": "item_id", "max_len": 10}]},
        },
        "model": {"kind": "din", "embedding_dim": 8, "hidden": [16],
                  "tasks": [{"name": "click"}, {"name": "conversion"},
                            {"name": "ad_type", "kind": "multiclass", "classes": 3}]},
        "train": {"batch_size": 256},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    cli("predict", "--checkpoint", tmp_path / "ck", "--data", data / "test.csv", "--out", tmp_path / "p.tsv")
    expected = np.loadtxt(tmp_path / "p.tsv", dtype=np.float32, delimiter="\t")
    assert expected.shape == (300, 5)
    model = sparrow.Model.load(tmp_path / "ck")
    assert model.kind == "din" and model.sequences == ["hist_items"]
    assert model.labels == ["click", "conversion", "ad_type"] and "hist_items" in model.inputs

    def check(got):
        assert sorted(got) == ["ad_type", "click", "conversion"]
        assert got["click"].shape == (300,) and got["ad_type"].shape == (300, 3)
        side_by_side = np.column_stack([got["click"], got["conversion"], got["ad_type"]])
        np.testing.assert_allclose(side_by_side, expected, rtol=0, atol=1e-6)

    check(model.predict(data / "test.csv"))
    frame = pd.read_csv(data / "test.csv", dtype={c: str for c in ids + ["hist_items"]}, keep_default_na=False)
    frame = frame.drop(columns=["converts", "cvr"])
    frame["hist_items"] = frame["hist_items"].map(lambda s: s.split("|") if s else [])
    check(model.predict(frame))
    check(model.predict({c: frame[c].tolist() for c in frame.columns}))
    # The file's string of IDs between separators reads the same.
    check(model.predict({**{c: frame[c].tolist() for c in frame.columns},
                         "hist_items": ["|".join(h) for h in frame["hist_items"]]}))
    # A rectangular [N, L] array of IDs, padded with "".
    longest = max(len(h) for h in frame["hist_items"])
    padded = np.array([h + [""] * (longest - len(h)) for h in frame["hist_items"]])
    check(model.predict({**{c: frame[c].tolist() for c in frame.columns}, "hist_items": padded}))
    with pytest.raises(sparrow.DataError, match="column `item_id` holds lists"):
        model.predict({**{c: frame[c].tolist() for c in frame.columns}, "item_id": [["i1"]] * 300})
    with pytest.raises(sparrow.DataError, match="column `hist_items`, row 0: an ID is a float"):
        model.predict({**{c: frame[c].tolist() for c in frame.columns}, "hist_items": [[1.5]] * 300})
