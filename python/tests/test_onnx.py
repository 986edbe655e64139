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
KINDS = ["lr", "fm", "mlp", "wide_deep", "deepfm", "dlrm", "dcn"]


def sparrow_cli(*args):
    binary = Path(os.environ.get("SPARROW_BIN", REPO / "target" / "release" / "sparrow"))
    done = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True)
    return done


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


def test_a_csv_model_takes_its_schemas_columns(tmp_path):
    data = tmp_path / "days"
    sparrow.gen(data, train_rows=5_000, test_rows=800, format="csv", days=2)
    dense, sparse = [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]
    config = {
        "data": {
            "format": "csv",
            "train": str(data / "train.csv"),
            "test": str(data / "test.csv"),
            "schema": {"label": "label", "dense": dense, "sparse": sparse, "dense_transform": "log1p",
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


def test_a_kind_the_export_cannot_rebuild_is_refused_by_name(tmp_path):
    data = tmp_path / "tasks"
    run("gen", "--out", data, "--train-rows", "2000", "--test-rows", "200", "--tasks", "--sequence", "--classes", "4")
    run("train", "--config", REPO / "configs" / "behaviour-tasks.toml", "--set", f"data.train={data}/train.csv",
        "--set", f"data.test={data}/test.csv", "--set", f"checkpoint.dir={tmp_path}/ck", "--set", "model.kind=mmoe",
        "--quiet")
    done = sparrow_cli("export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "onnx", "--format", "onnx")
    assert done.returncode == 2 and 'model.kind = "mmoe" cannot be exported as ONNX' in done.stderr, done.stderr
    assert not (tmp_path / "onnx").exists()
