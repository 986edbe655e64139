#!/usr/bin/env python3
"""The peer of Sparrow's speed target: the reference model trained by PyTorch
with TorchRec, from the same Criteo TSV, parsing alongside.

Model (as configs/reference-mlp.toml): 26 fields x dim 16, one table per
field (IDs hashed into `--hash-size` rows), concatenated with the 13 dense
values (log(1 + max(x, 0)), as Sparrow reads them), MLP 429-256-128-1;
per-coordinate Adagrad (lr 0.05) fused into the embedding backward (TorchRec's FusedEmbeddingBagCollection, FBGEMM's TBE kernels),
Adam (lr 0.001) on the MLP, batch 1024, `--threads` intra-op threads.
`--bf16`: the MLP under `torch.autocast("cpu", dtype=torch.bfloat16)`, as a
PyTorch user turns bf16 on (oneDNN's bf16 products: AMX's tiles where the CPU
has them, AVX-512-BF16 otherwise); the embeddings and the loss stay fp32.

Input: a second process parses the TSV with pandas' C reader in chunks and
hashes the categorical strings (pandas' vectorised hash), feeding batches
through a bounded queue, so parsing runs beside training as Sparrow's reader
thread does. Prints one JSON line: samples/s of the training loop (from the
first batch to the last, waiting for input included), wall time and, with
--test, the test AUC (rank statistic, ties averaged).

Run it through scripts/bench-peer, which installs the pinned packages from
PyPI into target/peer-venv and runs Sparrow beside it.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

DENSE = 13
SPARSE = 26


def parse_chunks(path, batch_size, hash_size, queue, max_rows):
    """Producer: parses the TSV into (labels, dense, ids) batches."""
    import numpy as np
    import pandas as pd

    names = ["label"] + [f"I{i}" for i in range(1, DENSE + 1)] + [f"C{i}" for i in range(1, SPARSE + 1)]
    dtypes = {"label": np.float32}
    dtypes.update({f"I{i}": np.float64 for i in range(1, DENSE + 1)})
    dtypes.update({f"C{i}": str for i in range(1, SPARSE + 1)})
    seen = 0
    reader = pd.read_csv(
        path,
        sep="\t",
        header=None,
        names=names,
        dtype=dtypes,
        chunksize=batch_size * 16,
        keep_default_na=False,
        na_values={f"I{i}": [""] for i in range(1, DENSE + 1)},
        engine="c",
    )
    for chunk in reader:
        labels = chunk["label"].to_numpy(np.float32)
        dense = chunk[[f"I{i}" for i in range(1, DENSE + 1)]].to_numpy(np.float64)
        dense = np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0)).astype(np.float32)
        ids = np.empty((len(chunk), SPARSE), dtype=np.int64)
        for f in range(SPARSE):
            hashed = pd.util.hash_array(chunk[f"C{f + 1}"].to_numpy(object), categorize=False)
            ids[:, f] = (hashed % np.uint64(hash_size)).astype(np.int64)
        for start in range(0, len(chunk), batch_size):
            end = min(start + batch_size, len(chunk))
            if max_rows and seen >= max_rows:
                queue.put(None)
                return
            queue.put((labels[start:end], dense[start:end], ids[start:end]))
            seen += end - start
    queue.put(None)


def batches(path, batch_size, hash_size, max_rows=0, depth=8):
    queue = mp.get_context("fork").Queue(maxsize=depth)
    producer = mp.get_context("fork").Process(
        target=parse_chunks, args=(path, batch_size, hash_size, queue, max_rows), daemon=True
    )
    producer.start()
    while True:
        item = queue.get()
        if item is None:
            break
        yield item
    producer.join()


def auc(labels, scores):
    import numpy as np

    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels[order] > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return None
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True)
    p.add_argument("--test")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--hash-size", type=int, default=400_000, help="rows of each field's table")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-rows", type=int, default=0, help="train on the first N rows (0: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--in-memory",
        action="store_true",
        help="parse the whole file first, then time the training loop alone (the peer's best case)",
    )
    p.add_argument("--bf16", action="store_true", help="the MLP under torch.autocast(cpu, bfloat16)")
    args = p.parse_args()

    import numpy as np
    import torch
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    keys = [f"C{i}" for i in range(1, SPARSE + 1)]
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=args.dim, num_embeddings=args.hash_size, feature_names=[k]
        )
        for k in keys
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=torch.optim.Adagrad,
        optimizer_kwargs={"lr": 0.05, "eps": 1e-8},
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for w in ebc.parameters():
            w.uniform_(-0.01, 0.01)
    sizes = [SPARSE * args.dim + DENSE] + [int(h) for h in args.hidden.split(",")]
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(sizes[-1], 1))
    mlp = torch.nn.Sequential(*layers)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=0.001)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def features(ids):
        n = ids.shape[0]
        # Field-major values, one ID per sample and field.
        values = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))
        lengths = torch.ones(n * SPARSE, dtype=torch.int32)
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)

    def forward(dense, ids):
        pooled = ebc(features(ids)).values()
        x = torch.cat([pooled, torch.from_numpy(dense)], dim=1)
        if args.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = mlp(x)
            return y.float().squeeze(1)
        return mlp(x).squeeze(1)

    wall = time.perf_counter()
    source = batches(args.train, args.batch_size, args.hash_size, args.max_rows)
    parse_secs = None
    if args.in_memory:
        source = list(source)
        parse_secs = time.perf_counter() - wall
    rows, first, loss_sum = 0, None, 0.0
    for labels, dense, ids in source:
        if first is None:
            first = time.perf_counter()
        logits = forward(dense, ids)
        loss = loss_fn(logits, torch.from_numpy(labels))
        dense_opt.zero_grad()
        loss.backward()  # the fused embedding optimizer steps here
        dense_opt.step()
        rows += len(labels)
        loss_sum += float(loss.detach()) * len(labels)
    loop = time.perf_counter() - (first or wall)
    out = {
        "peer": "pytorch+torchrec",
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "threads": args.threads,
        "precision": "bf16 autocast" if args.bf16 else "f32",
        "input": "in memory (loop alone)" if args.in_memory else "parsed alongside",
        "parse_secs": parse_secs,
        "train_rows": rows,
        "train_logloss": loss_sum / max(rows, 1),
        "samples_per_sec": rows / loop if loop > 0 else None,
        "train_secs": time.perf_counter() - wall,
    }
    if args.test:
        scores, truth = [], []
        with torch.no_grad():
            for labels, dense, ids in batches(args.test, 8192, args.hash_size):
                scores.append(torch.sigmoid(forward(dense, ids)).numpy())
                truth.append(labels)
        out["test_auc"] = auc(np.concatenate(truth), np.concatenate(scores))
    out["wall_secs"] = time.perf_counter() - wall
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
