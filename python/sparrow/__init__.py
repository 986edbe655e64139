"""Sparrow from Python: the `sparrow` command's train, gen, eval and predict
as functions, on the same Rust library (the numbers are the CLI's).

    import sparrow
    truth = sparrow.gen("data", train_rows=200_000, test_rows=20_000)
    summary = sparrow.train("configs/mlp.toml", **{"data.train": "data/train.tsv"})
    model = sparrow.Model.load("checkpoints")
    probabilities = model.predict(dataframe)

Library warnings go to Python's `logging` (loggers `sparrow_trainer`,
`sparrow_data`, ...). Errors are the classes below, with the CLI's messages.
"""

import datetime
import decimal
import json
import os
import re
import sys

# The dense model's elementwise ops run inline (one candle thread): the
# compute pool already uses every core. Set before the native module loads.
os.environ.setdefault("CANDLE_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from . import _native  # noqa: E402
from ._errors import (  # noqa: E402
    ArgumentError,
    CheckpointError,
    ConfigError,
    DataError,
    DivergedError,
    FileError,
    SparrowError,
)

__version__ = _native.__version__

__all__ = [
    "train",
    "gen",
    "evaluate",
    "Model",
    "SparrowError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "FileError",
    "DivergedError",
    "ArgumentError",
]


# Cells whose text is their value (an object column may hold any of them).
_SCALARS = (str, int, float, np.generic, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal)

# A config key: dotted bare names, nothing that could end a TOML line.
_DOTTED_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+")


def _override_list(overrides):
    """`{"embedding.learning_rate": 0.1}` as the CLI's `KEY=VALUE` strings
    (values written as TOML literals: JSON's are, for str, numbers, bools
    and lists)."""
    out = []
    for key, value in overrides.items():
        if not _DOTTED_KEY.fullmatch(key):
            raise ArgumentError(
                f"override {key!r}: config keys are written SECTION.KEY, letters, digits, `_` and `-` "
                "(e.g. embedding.learning_rate)"
            )
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        try:
            literal = json.dumps(value)
        except TypeError as e:
            raise ArgumentError(f"override `{key}`: {e}") from None
        out.append(f"{key}={literal}")
    return out


class _Progress:
    """A tqdm bar when tqdm is installed, plain lines on stderr otherwise."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.bar = None
        self.tqdm = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.tqdm = tqdm
            except ImportError:
                pass

    def __call__(self, update):
        if self.tqdm is not None:
            if self.bar is None:
                self.bar = self.tqdm(
                    total=update["bytes_total"], unit="B", unit_scale=True, desc="train", file=sys.stderr
                )
            self.bar.update(max(0, update["bytes_done"] - self.bar.n))
            self.bar.set_postfix(
                step=update["step"],
                loss=f"{update['train_logloss']:.4f}",
                samples_s=f"{update['samples_per_sec']:.0f}",
                refresh=False,
            )
        else:
            print(
                f"step {update['step']} epoch {update['epoch']} samples {update['samples']} "
                f"train_logloss {update['train_logloss']:.5f} samples/s {update['samples_per_sec']:.0f}",
                file=sys.stderr,
                flush=True,
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train(config, *, progress=True, resume=None, **overrides):
    """Train (and evaluate on `data.test`) as `config` says: a TOML file's
    path, or a dict shaped like one (`{"model": {"kind": "mlp"}, ...}`).

    Overrides are config keys, as `sparrow train --set` takes them:
    `sparrow.train("c.toml", **{"embedding.learning_rate": 0.1})`.
    `resume` continues from a checkpoint. `progress` draws a bar (tqdm when
    installed, plain lines otherwise) or calls `progress(update)` when given a
    callable. Returns the summary `sparrow train` prints (a dict).

    The GIL is released while training runs. Ctrl-C stops training after the
    current step, writes the checkpoint (when `checkpoint.dir` is set) and
    raises KeyboardInterrupt saying where the model is.
    """
    if resume is not None:
        overrides["checkpoint.resume_from"] = os.fspath(resume)
    sets = _override_list(overrides)
    if isinstance(config, dict):
        path, text = None, json.dumps(config)
    else:
        path, text = os.fspath(config), None
    if callable(progress):
        hook, closer = progress, None
    else:
        closer = _Progress(bool(progress))
        hook = closer if closer.enabled else None
    try:
        summary = _native.train(path, text, sets, hook, True)
    finally:
        if closer is not None:
            closer.close()
    return json.loads(summary)


def gen(out, train_rows=1_000_000, test_rows=100_000, seed=1, format="criteo", days=None, shuffled=False):
    """Generate train/test data whose true click probabilities are known
    (`sparrow gen`): `format="criteo"` writes train.tsv and test.tsv,
    `"csv"` train.csv and test.csv with a `ts` column. Returns `truth.json`."""
    truth = _native.generate(os.fspath(out), int(train_rows), int(test_rows), int(seed), format, days, bool(shuffled))
    return json.loads(truth)


def evaluate(checkpoint, data, **overrides):
    """AUC and log-loss of a checkpoint on a data file (`sparrow eval`)."""
    summary = _native.evaluate(os.fspath(checkpoint), os.fspath(data), _override_list(overrides))
    return json.loads(summary)


def _is_list(v):
    return isinstance(v, (list, tuple, np.ndarray))


def _list_column(name, values):
    """A behaviour sequence's column: a list of IDs a row (None: an empty
    history); each ID a str, bytes or an integer (its decimal)."""

    def ids(row, v):
        if v is None or (isinstance(v, float) and v != v):
            return []
        if not _is_list(v):
            raise DataError(f"column `{name}`, row {row}: a {type(v).__name__} is not a list of IDs")
        out = []
        for i in (v.tolist() if isinstance(v, np.ndarray) else v):
            if isinstance(i, (bytes, np.bytes_)):
                out.append(bytes(i).decode())
            elif isinstance(i, (str, int, np.integer)) and not isinstance(i, bool):
                out.append(str(i))
            else:
                raise DataError(f"column `{name}`, row {row}: an ID is a {type(i).__name__} (str, bytes or int)")
        return out

    return (name, "l", [ids(row, v) for row, v in enumerate(values)])


def _column(name, values):
    """One column as the native module takes it: numbers as 8-byte words,
    lists (a behaviour sequence's IDs a row) as lists of str, anything else
    as a list of str (None and NaN: an empty cell)."""
    if isinstance(values, np.ndarray) and values.ndim == 2:
        # A rectangular history, a row a row ("" or None pad it).
        return _list_column(name, [[i for i in row if i is not None] for row in values.tolist()])
    rows = values.tolist() if isinstance(values, np.ndarray) and values.dtype.kind == "O" else values
    if isinstance(rows, (list, tuple)) and any(_is_list(v) for v in rows):
        return _list_column(name, rows)
    array = np.asarray(values)
    if array.ndim != 1:
        raise DataError(f"column `{name}`: expected one value per row, got shape {array.shape}")
    kind = array.dtype.kind
    if kind == "f":
        return (name, "f", np.ascontiguousarray(array, dtype=np.float64).tobytes())
    if kind in "ib":
        return (name, "i", np.ascontiguousarray(array, dtype=np.int64).tobytes())
    if kind == "u":
        return (name, "u", np.ascontiguousarray(array, dtype=np.uint64).tobytes())
    if kind == "U":
        return (name, "s", array.tolist())
    if kind == "S":
        return (name, "s", [v.decode() for v in array.tolist()])

    def text(row, v):
        if v is None or (isinstance(v, float) and v != v) or type(v).__name__ in ("NAType", "NaTType"):
            return ""
        if isinstance(v, (bytes, np.bytes_)):
            return bytes(v).decode()
        if isinstance(v, _SCALARS):
            return str(v)
        # Anything else would be its repr, often with a memory address: an ID
        # that changes from run to run.
        raise DataError(
            f"column `{name}`, row {row}: a {type(v).__name__} is not a value "
            "(numbers, strings, bytes and None are)"
        )

    return (name, "s", [text(row, v) for row, v in enumerate(array.tolist())])


def _by_task(raw, layout):
    """The native rows of probabilities (each row's tasks side by side) as
    one array (one binary task) or a dict of a column per task."""
    values = np.frombuffer(raw, dtype=np.float32).copy()
    if len(layout) == 1 and layout[0][1] == 1:
        return values
    width = sum(w for _, w in layout)
    rows = values.reshape(-1, width) if width else values.reshape(0, 0)
    out, at = {}, 0
    for name, w in layout:
        out[name] = rows[:, at].copy() if w == 1 else rows[:, at : at + w].copy()
        at += w
    return out


class Model:
    """A trained model, from a checkpoint or a serving export (`sparrow
    export`), or a directory whose LATEST names one."""

    def __init__(self, native):
        self._native = native
        info = native.info()
        self.kind = info["model"]
        self.format = info["format"]
        self.label = info.get("label")
        # One label column a task; `sequences`: the inputs that take a list of IDs a row.
        self.labels = info.get("labels", [self.label] if self.label else [])
        self.sequences = info.get("sequences", [])
        self.inputs = info.get("inputs", [])

    @classmethod
    def load(cls, path, **overrides):
        """Loads a checkpoint or an export; overrides apply to its stored
        config (e.g. `**{"data.format": "csv"}` for data in another format)."""
        return cls(_native.Model.load(os.fspath(path), _override_list(overrides)))

    @property
    def step(self):
        """The training step the model was saved at."""
        return self._native.step

    @property
    def outputs(self):
        """The outputs `sparrow serve` and the ONNX export answer for this
        model, in their order: (name, values a row) pairs, e.g.
        `[("probability", 1)]`, or a `probability_<task>` / `probabilities_<task>`
        a task."""
        return self._native.outputs()

    def predict(self, data):
        """Click probabilities (numpy float32), equal to `sparrow predict` on
        the same rows: `data` is a data file's path, a dict of columns
        (numpy arrays or lists, named as the model's `inputs`), or a pandas
        DataFrame. A missing column, None or NaN reads as an empty cell; the
        label columns (and a CSV model's timestamp column), if given, are
        ignored. No file is written: each value goes into the model's batch
        through the data format's reading rules.

        A behaviour sequence's column (`Model.sequences`) holds a list of
        IDs a row (or the file's string of them between the separator), or
        is a 2-D array of IDs padded with empty strings.

        A model of one binary task returns one array. A model of several
        tasks (or a multiclass one) returns a dict, task name to its column:
        float32 [N] for a binary task, [N, classes] for a multiclass one."""
        if isinstance(data, (str, os.PathLike)):
            return _by_task(*self._native.predict_file(os.fspath(data)))
        else:
            if hasattr(data, "columns") and hasattr(data, "__getitem__"):  # a pandas DataFrame
                columns = {str(c): data[c].to_numpy() for c in data.columns}
            elif hasattr(data, "items"):
                columns = dict(data.items())
            else:
                raise ArgumentError(
                    f"predict takes a file path, a dict of columns or a DataFrame, not {type(data).__name__}"
                )
            raw = self._native.predict_columns([_column(str(n), v) for n, v in columns.items()])
        return _by_task(*raw)

    def __repr__(self):
        return f"sparrow.Model({self._native.path!r}, kind={self.kind!r}, step={self.step})"
