"""`sparrow export --format onnx`: the graph runs in ONNX Runtime (PyPI's
onnxruntime, as Triton's ONNX backend runs it) on the inputs `sparrow serve`
takes, and its probabilities equal `sparrow predict`'s."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import sparrow

ort = pytest.importorskip("onnxruntime")

REPO = Path(__file__).resolve().parents[2]


def sparrow_cli(*args):
    binary = Path(os.environ.get("SPARROW_BIN", REPO / "target" / "release" / "sparrow"))
    done = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True)
    return done


def one_task_kinds():
    """The registry's kinds for one or more tasks (`sparrow kinds`): a kind
    added there is exported and checked here without a line of its own."""
    done = sparrow_cli("kinds")
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1) for line in done.stdout.splitlines()]
    kinds = [name for name, rest in rows if rest.startswith(("one binary task", "one or more tasks"))]
    assert "lr" in kinds and "dcn" in kinds, done.stdout
    return kinds


KINDS = one_task_kinds()


def run(*args):
    done = sparrow_cli(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_floats(path):
    return np.array([float(line) for line in Path(path).read_text().split()], dtype=np.float32)


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx-gen")
    sparrow.gen(out, train_rows=8_000, test_rows=1_500, seed=11)
    return out


def criteo_columns(path):
    """A Criteo file's rows as the KServe inputs: I1..I13 float32 (an empty
    count is NaN, as a client sends a missing value), C1..C26 strings."""
    rows = [line.rstrip("\n").split("\t") for line in Path(path).read_text().splitlines()]
    cell = lambda r, i: r[i] if i < len(r) else ""
    feed = {f"I{i}": np.array([float(cell(r, i)) if cell(r, i) else np.nan for r in rows], np.float32)
            for i in range(1, 14)}
    feed.update({f"C{i}": np.array([cell(r, 13 + i) for r in rows], dtype=object) for i in range(1, 27)})
    return feed


def session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_runtime_gives_predicts_probabilities_for_every_kind(criteo, tmp_path, kind):
    config = {
        "data": {"train": str(criteo / "train.tsv"), "test": str(criteo / "test.tsv")},
        "model": {"kind": kind, "embedding_dim": 8, "hidden": [32, 16], "bottom_hidden": [16]},
        "train": {"batch_size": 512, "epochs": 2},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    summary = run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    assert summary["embedded"] and summary["ids"] > 0 and summary["format"] == "onnx"
    run("predict", "--checkpoint", tmp_path / "ck", "--data", criteo / "test.tsv", "--out", tmp_path / "p.txt")
    expected = read_floats(tmp_path / "p.txt")

    model = session(tmp_path / "onnx" / "model.onnx")
    names = [i.name for i in model.get_inputs()]
    assert names == [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    assert [o.name for o in model.get_outputs()] == ["probability"]
    (got,) = model.run(["probability"], criteo_columns(criteo / "test.tsv"))
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # The predictions are not all alike: the comparison compares something.
    assert got.std() > 1e-3


def test_an_id_no_file_holds_reads_as_a_zero_vector_and_a_batch_of_one_runs(criteo, tmp_path):
    config = {
        "data": {"train": str(criteo / "train.tsv"), "test": str(criteo / "test.tsv")},
        "model": {"kind": "mlp", "embedding_dim": 8, "hidden": [16]},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    model = session(tmp_path / "onnx" / "model.onnx")
    feed = {k: v[:1] for k, v in criteo_columns(criteo / "test.tsv").items()}
    (one,) = model.run(["probability"], feed)
    feed["C3"] = np.array(["an id never seen"], dtype=object)
    (novel,) = model.run(["probability"], feed)
    assert one.shape == (1,) and np.isfinite(novel).all() and novel[0] != one[0]


@pytest.mark.parametrize("transform", ["log1p", "standardize"])
def test_a_csv_model_takes_its_schemas_columns(tmp_path, transform):
    """`standardize`: the first pass's means and deviations travel in the
    checkpoint's config into the graph (a Sub and a Mul by column)."""
    data = tmp_path / "days"
    sparrow.gen(data, train_rows=5_000, test_rows=800, format="csv", days=2)
    dense, sparse = [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]
    config = {
        "data": {
            "format": "csv",
            "train": str(data / "train.csv"),
            "test": str(data / "test.csv"),
            "schema": {"label": "label", "dense": dense, "sparse": sparse, "dense_transform": transform,
                       "timestamp": "ts"},
        },
        "model": {"kind": "deepfm", "embedding_dim": 8, "hidden": [16]},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    run("predict", "--checkpoint", tmp_path / "ck", "--data", data / "test.csv", "--out", tmp_path / "p.txt")
    lines = (data / "test.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [line.split(",") for line in lines[1:]]
    col = {name: [r[header.index(name)] for r in rows] for name in dense + sparse}
    feed = {n: np.array([float(x) if x else np.nan for x in col[n]], np.float32) for n in dense}
    feed.update({n: np.array(col[n], dtype=object) for n in sparse})
    (got,) = session(tmp_path / "onnx" / "model.onnx").run(["probability"], feed)
    np.testing.assert_allclose(got, read_floats(tmp_path / "p.txt"), rtol=0, atol=1e-5)
    # The Python module reads the columns through the same statistics.
    model = sparrow.Model.load(tmp_path / "ck")
    scored = model.predict({n: feed[n] for n in dense + sparse})
    np.testing.assert_allclose(np.asarray(scored).reshape(-1), read_floats(tmp_path / "p.txt"), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx-tasks")
    run("gen", "--out", out, "--train-rows", "6000", "--test-rows", "800", "--tasks", "--sequence", "--classes", "4")
    return out


def behaviour_config(data, ckpt, kind, **model):
    """configs/behaviour-tasks.toml (three tasks, multi-hot cells, a
    behaviour sequence sharing item_id's table) on `data`, for `kind`."""
    import tomllib

    config = tomllib.loads((REPO / "configs" / "behaviour-tasks.toml").read_text())
    config["data"].update(train=str(data / "train.csv"), test=str(data / "test.csv"))
    config["model"].update(kind=kind, embedding_dim=8, **model)
    config["checkpoint"] = {"dir": str(ckpt)}
    if kind == "esmm":  # ESMM's two binary tasks: click, then conversion
        config["data"]["schema"]["labels"] = ["click", "conversion"]
        config["model"]["tasks"] = [t for t in config["model"]["tasks"] if t["name"] != "ad_type"]
    return config


def csv_columns(path, session):
    """A CSV file's rows as the graph's inputs: numbers as float32 (empty:
    NaN), every other column as the cell's string (a list as the file
    joins it)."""
    import csv

    rows = list(csv.DictReader(Path(path).open()))
    feed = {}
    for i in session.get_inputs():
        cells = [r[i.name] for r in rows]
        if i.type == "tensor(float)":
            feed[i.name] = np.array([float(c) if c else np.nan for c in cells], np.float32)
        else:
            feed[i.name] = np.array(cells, dtype=object)
    return feed


@pytest.mark.parametrize("kind,model", [("mlp", {}), ("esmm", {}), ("mmoe", {}), ("ple", {}), ("din", {}),
                                        ("dlrm", {"pooling": "mean"}),
                                        ("mlp", {"norm": "layer", "dropout": 0.1}),
                                        ("mmoe", {"norm": "layer"}),
                                        ("dlrm", {"norm": "batch", "dropout": 0.1}),
                                        ("ple", {"norm": "batch"}),
                                        ("mlp", {"activation": "prelu", "norm": "batch"}),
                                        ("din", {"activation": "gelu", "attention_activation": "dice"}),
                                        ("mmoe", {"activation": "silu"}),
                                        ("dlrm", {"activation": "dice", "dropout": 0.1})])
def test_several_tasks_multi_hot_cells_and_sequences_give_an_output_per_task(behaviour, tmp_path, kind, model):
    config = behaviour_config(behaviour, tmp_path / "ck", kind, **model)
    if kind == "din":  # keep only the newest 3 items: the graph must drop the same ones
        config["data"]["schema"]["sequence"][0]["max_len"] = 3
    sparrow.train(config, progress=False)
    run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    run("predict", "--checkpoint", tmp_path / "ck", "--data", behaviour / "test.csv", "--out", tmp_path / "p.txt")
    lines = (tmp_path / "p.txt").read_text().splitlines()
    expected = np.array([[float(x) for x in line.split("\t")] for line in lines], np.float32)
    model = session(tmp_path / "onnx" / "model.onnx")
    assert [i.name for i in model.get_inputs()][-1] == "hist_items"
    names = [o.name for o in model.get_outputs()]
    got = dict(zip(names, model.run(names, csv_columns(behaviour / "test.csv", model))))
    tasks = [t["name"] for t in config["model"]["tasks"]]
    columns, at = [], 0
    for t in config["model"]["tasks"]:
        if t.get("kind") == "multiclass":
            columns.append(got[f"probabilities_{t['name']}"])
            assert got[f"probabilities_{t['name']}"].shape == (len(expected), t["classes"])
        else:
            columns.append(got[f"probability_{t['name']}"][:, None])
    np.testing.assert_allclose(np.concatenate(columns, axis=1), expected, rtol=0, atol=1e-5)
    # `probability` is the first task's, as `sparrow serve` answers it.
    np.testing.assert_array_equal(got["probability"], got[f"probability_{tasks[0]}"])
    # Python names the graph's outputs alike, with their widths (one ServedOutput list).
    outputs = sparrow.Model.load(tmp_path / "ck").outputs
    assert [n for n, _ in outputs] == names
    assert all(got[n].shape == ((len(expected),) if w == 1 else (len(expected), w)) for n, w in outputs)


def test_din_with_its_rows_outside_the_graph_is_refused_by_name(behaviour, tmp_path):
    sparrow.train(behaviour_config(behaviour, tmp_path / "ck", "din"), progress=False)
    done = sparrow_cli("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx",
                       "--max-table-bytes", "0")
    assert done.returncode == 2 and "din" in done.stderr and "--max-table-bytes" in done.stderr, done.stderr
    assert not (tmp_path / "onnx").exists()


def test_tables_past_the_inline_limit_go_beside_the_graph_and_onnx_runtime_loads_them(criteo, tmp_path):
    """Issue 53 item 3: a model past protobuf's 2 GiB was written whole and
    reported as success (ONNX Runtime refused it). Past --max-inline-bytes
    (lowered here, to keep the files small) the tables go to
    model.onnx.data as ONNX external data, and ONNX Runtime loads and
    scores the two files as it scores the one."""
    config = {
        "data": {"train": str(criteo / "train.tsv"), "test": str(criteo / "test.tsv")},
        "model": {"kind": "mlp", "embedding_dim": 64, "hidden": [16]},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    sparrow.train(config, progress=False)
    whole = run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "whole", "--format", "onnx")
    assert whole["external_data"] is None and whole["external_bytes"] == 0
    limit = whole["bytes"] // 2  # the rows are most of it at dim 64; the IDs' strings stay inline
    split = run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "split", "--format", "onnx",
                "--max-inline-bytes", limit)
    assert split["embedded"] and split["bytes"] <= limit < whole["bytes"], split
    data = Path(split["external_data"])
    assert data == tmp_path / "split" / "model.onnx.data" and data.stat().st_size == split["external_bytes"] > limit
    feed = criteo_columns(criteo / "test.tsv")
    (expected,) = session(tmp_path / "whole" / "model.onnx").run(["probability"], feed)
    (got,) = session(tmp_path / "split" / "model.onnx").run(["probability"], feed)
    np.testing.assert_array_equal(got, expected)
    assert got.std() > 1e-3
    # A limit the graph cannot meet even with its tables beside it: refused by name, nothing left.
    done = sparrow_cli("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "tiny", "--format", "onnx",
                       "--max-inline-bytes", "100")
    assert done.returncode == 2 and "--max-table-bytes" in done.stderr and "model file" in done.stderr, done.stderr
    assert not (tmp_path / "tiny").exists()


def test_a_bucketized_column_reads_as_its_bucket_in_predict_python_and_the_graph(tmp_path):
    """`[[data.schema.buckets]]`: a numeric column (some cells empty) read
    as the bucket its value falls in, by `sparrow predict`, the Python
    module and the ONNX graph (a float input, compared with the boundaries)."""
    rng = np.random.default_rng(5)
    rows = 3000
    age = rng.uniform(0, 90, rows).round(1)
    city = rng.integers(0, 30, rows)
    p = 1 / (1 + np.exp(-(np.where((age >= 25) & (age < 45), 1.5, -1.0) + (city % 3 - 1) * 0.5)))
    label = (rng.uniform(size=rows) < p).astype(int)
    lines = ["label,age,city"]
    for i in range(rows):
        lines.append(f"{label[i]},{'' if i % 17 == 0 else age[i]},c{city[i]}")
    (tmp_path / "train.csv").write_text("\n".join(lines[:2501]) + "\n")
    (tmp_path / "test.csv").write_text("\n".join([lines[0]] + lines[2501:]) + "\n")
    config = {
        "data": {
            "format": "csv",
            "train": str(tmp_path / "train.csv"),
            "test": str(tmp_path / "test.csv"),
            "schema": {"label": "label", "sparse": ["age", "city"],
                       "buckets": [{"column": "age", "boundaries": [18, 25, 35, 45, 65]}]},
        },
        "model": {"kind": "mlp", "embedding_dim": 4, "hidden": [8]},
        "train": {"epochs": 3, "batch_size": 128},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    summary = sparrow.train(config, progress=False)
    # The bands carry the signal a raw age string would spread over 900 IDs.
    assert summary["test_auc"] > 0.7, summary
    run("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    run("predict", "--checkpoint", tmp_path / "ck", "--data", tmp_path / "test.csv", "--out", tmp_path / "p.txt")
    expected = read_floats(tmp_path / "p.txt")
    model = session(tmp_path / "onnx" / "model.onnx")
    feed = csv_columns(tmp_path / "test.csv", model)
    assert feed["age"].dtype == np.float32 and np.isnan(feed["age"]).any()
    (got,) = model.run(["probability"], feed)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    scored = sparrow.Model.load(tmp_path / "ck").predict({"age": feed["age"].astype(np.float64), "city": feed["city"]})
    np.testing.assert_allclose(np.asarray(scored).reshape(-1), expected, rtol=0, atol=1e-6)
