#!/usr/bin/env python3
"""The PyTorch peers of scripts/bench-real: torch-rechub's and DeepCTR-Torch's
own multi-task models on a log prepared by scripts/real_logs.py, trained with
each library's own training step, scored on the test split.

    peer_real.py --lib rechub|deepctr --model sharedbottom|mmoe|ple|din|deepfm --data DIR
                 [--epochs 5] [--batch 256] [--dim 16] [--seed 1]

Sizes are torch-rechub's census-income example's: the shared bottom [117]
with towers [8]; MMoE 8 experts of [16], towers [8]; PLE one level of one
shared and two per-task experts of [16], towers [8]. Gates are one linear
layer and a softmax in both libraries. DIN (a log with a behaviour
sequence): the DIN paper's MLP [200, 80] and an attention unit of [36] with
Dice, as both libraries default to; the history shares the candidate's
embedding table. DeepFM (a click log): an FM of the categorical columns beside
an MLP [256, 128] of them and the dense columns, DeepCTR-Torch's default
sizes; the FM's vectors are the MLP's (one table a column) in both. Inputs as both libraries' examples
make them: each categorical column a vocabulary built on the training rows
(0: unseen), each multi-hot column padded with 0 and mean-pooled, dense
columns standardized by the training rows' mean and standard deviation.

Prints one JSON line: the training loop's samples/s (the epochs' steps only,
tensors made beforehand), the whole run's seconds, and each task's test AUC.
"""

import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score

SIZES = {"bottom": [117], "tower": [8], "experts": 8, "expert": [16], "ple_specific": 2, "ple_shared": 1,
         "din_hidden": [200, 80], "attention": [36], "deepfm_hidden": [256, 128]}


def load(data):
    meta = json.load(open(os.path.join(data, "meta.json")))
    parts = {p: pd.read_csv(os.path.join(data, f"{p}.csv"), dtype=str, keep_default_na=False)
             for p in ("train", "test")}
    train, test = parts["train"], parts["test"]
    inputs = {"train": {}, "test": {}}
    vocab = {}
    for col in meta["sparse"]:
        index = {v: i + 1 for i, v in enumerate(sorted(set(train[col])))}
        vocab[col] = len(index) + 1
        for p, frame in parts.items():
            inputs[p][col] = np.array([index.get(v, 0) for v in frame[col]], dtype=np.int64)
    lengths = {}
    sep = meta["separator"]
    for col in meta["multi_hot"]:
        split = {p: [c.split(sep) if c else [] for c in frame[col]] for p, frame in parts.items()}
        index = {v: i + 1 for i, v in enumerate(sorted({w for ws in split["train"] for w in ws}))}
        vocab[col] = len(index) + 1
        width = max(1, max(len(ws) for ws in split["train"]))
        lengths[col] = width
        for p in parts:
            out = np.zeros((len(split[p]), width), dtype=np.int64)
            for r, ws in enumerate(split[p]):
                ids = [i for i in (index.get(w, 0) for w in ws[:width]) if i]
                out[r, :len(ids)] = ids
            inputs[p][col] = out
    sequence = meta.get("sequence")
    if sequence:
        # The history takes the candidate's vocabulary (its table's), padded
        # with 0 on the right; the newest max_len items, as Sparrow keeps.
        col, table = sequence["field"], sequence["table"]
        index = {v: i + 1 for i, v in enumerate(sorted(set(train[table])))}
        width = sequence["max_len"]
        lengths[col] = width
        for p, frame in parts.items():
            out = np.zeros((len(frame), width), dtype=np.int64)
            seq_len = np.zeros(len(frame), dtype=np.int64)
            for r, cell in enumerate(frame[col]):
                ids = [index.get(w, 0) for w in (cell.split(sep) if cell else [])][-width:]
                out[r, :len(ids)] = ids
                seq_len[r] = len(ids)
            inputs[p][col] = out
            inputs[p]["seq_length"] = seq_len
    for col in meta["dense"]:
        values = {p: frame[col].astype(float).to_numpy() for p, frame in parts.items()}
        mean, std = values["train"].mean(), values["train"].std() or 1.0
        for p in parts:
            inputs[p][col] = ((values[p] - mean) / std).astype(np.float32)
    labels = {p: np.stack([frame[t].astype(float).to_numpy() for t in meta["labels"]], axis=1).astype(np.float32)
              for p, frame in parts.items()}
    return meta, inputs, labels, vocab, lengths


class Dicts(torch.utils.data.Dataset):
    """A part's inputs as torch-rechub's DataLoaders hand them: a dict a row."""

    def __init__(self, inputs, labels):
        self.x = {k: torch.from_numpy(v) for k, v in inputs.items()}
        self.y = torch.from_numpy(labels)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.x.items()}, self.y[i]


def rechub_ctr(args, model, inputs, labels):
    """A one-task model through torch-rechub's CTRTrainer: the epochs'
    seconds and the test rows' predictions."""
    from torch.utils.data import DataLoader
    from torch_rechub.trainers import CTRTrainer

    trainer = CTRTrainer(model, optimizer_params={"lr": args.lr, "weight_decay": 1e-5}, n_epoch=args.epochs,
                         device="cpu", model_path=args.scratch)
    train = DataLoader(Dicts(inputs["train"], labels["train"][:, 0]), batch_size=args.batch, shuffle=True)
    test = DataLoader(Dicts(inputs["test"], labels["test"][:, 0]), batch_size=4096)
    start = time.perf_counter()
    for _ in range(args.epochs):
        trainer.train_one_epoch(train)
    train_secs = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        preds = np.concatenate([model(x).numpy() for x, _ in test])
    return train_secs, preds[:, None]


def rechub_din(args, meta, inputs, labels, vocab, lengths):
    from torch_rechub.basic.features import SequenceFeature, SparseFeature
    from torch_rechub.models.ranking import DIN

    seq = meta["sequence"]
    features = [SparseFeature(c, vocab[c], embed_dim=args.dim) for c in meta["sparse"] if c != seq["table"]]
    target = [SparseFeature(seq["table"], vocab[seq["table"]], embed_dim=args.dim)]
    history = [SequenceFeature(seq["field"], vocab[seq["table"]], embed_dim=args.dim, pooling="concat",
                               shared_with=seq["table"])]
    model = DIN(features, history, target, mlp_params={"dims": SIZES["din_hidden"]},
                attention_mlp_params={"dims": SIZES["attention"]})
    return rechub_ctr(args, model, inputs, labels)


def deepctr_din(args, meta, inputs, labels, vocab, lengths):
    from deepctr_torch.inputs import SparseFeat, VarLenSparseFeat
    from deepctr_torch.models import DIN

    seq = meta["sequence"]
    # DeepCTR-Torch finds a candidate's history as "hist_" + its name.
    hist = "hist_" + seq["table"]
    columns = [SparseFeat(c, vocab[c], embedding_dim=args.dim) for c in meta["sparse"]]
    columns += [VarLenSparseFeat(SparseFeat(hist, vocab[seq["table"]], embedding_dim=args.dim,
                                            embedding_name=seq["table"]), maxlen=seq["max_len"],
                                 length_name="seq_length")]
    renamed = {p: {hist if k == seq["field"] else k: v for k, v in part.items()} for p, part in inputs.items()}
    model = DIN(columns, [seq["table"]], dnn_hidden_units=SIZES["din_hidden"], att_hidden_size=SIZES["attention"],
                att_activation="Dice", seed=args.seed, device="cpu")
    model.compile(torch.optim.Adam(model.parameters(), lr=args.lr), "binary_crossentropy")
    start = time.perf_counter()
    model.fit(renamed["train"], labels["train"][:, 0], batch_size=args.batch, epochs=args.epochs, verbose=0)
    train_secs = time.perf_counter() - start
    return train_secs, model.predict(renamed["test"], batch_size=4096)


def rechub_deepfm(args, meta, inputs, labels, vocab, lengths):
    from torch_rechub.basic.features import DenseFeature, SparseFeature
    from torch_rechub.models.ranking import DeepFM

    sparse = [SparseFeature(c, vocab[c], embed_dim=args.dim) for c in meta["sparse"]]
    dense = [DenseFeature(c) for c in meta["dense"]]
    model = DeepFM(deep_features=sparse + dense, fm_features=sparse, mlp_params={"dims": SIZES["deepfm_hidden"]})
    return rechub_ctr(args, model, inputs, labels)


def deepctr_deepfm(args, meta, inputs, labels, vocab, lengths):
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    columns = [SparseFeat(c, vocab[c], embedding_dim=args.dim) for c in meta["sparse"]]
    columns += [DenseFeat(c, 1) for c in meta["dense"]]
    model = DeepFM(columns, columns, dnn_hidden_units=SIZES["deepfm_hidden"], seed=args.seed, device="cpu")
    model.compile(torch.optim.Adam(model.parameters(), lr=args.lr), "binary_crossentropy")
    start = time.perf_counter()
    model.fit(inputs["train"], labels["train"][:, 0], batch_size=args.batch, epochs=args.epochs, verbose=0)
    train_secs = time.perf_counter() - start
    return train_secs, model.predict(inputs["test"], batch_size=4096)


def rechub(args, meta, inputs, labels, vocab, lengths):
    from torch.utils.data import DataLoader
    from torch_rechub.basic.features import DenseFeature, SequenceFeature, SparseFeature
    from torch_rechub.models.multi_task import MMOE, PLE, SharedBottom
    from torch_rechub.trainers import MTLTrainer

    features = [SparseFeature(c, vocab[c], embed_dim=args.dim) for c in meta["sparse"]]
    features += [SequenceFeature(c, vocab[c], embed_dim=args.dim, pooling="mean", padding_idx=0)
                 for c in meta["multi_hot"]]
    features += [DenseFeature(c) for c in meta["dense"]]
    n = len(meta["labels"])
    types = ["classification"] * n
    towers = [{"dims": SIZES["tower"]}] * n
    if args.model == "sharedbottom":
        model = SharedBottom(features, types, {"dims": SIZES["bottom"]}, towers)
    elif args.model == "mmoe":
        model = MMOE(features, types, SIZES["experts"], {"dims": SIZES["expert"]}, towers)
    else:
        model = PLE(features, types, n_level=1, n_expert_specific=SIZES["ple_specific"],
                    n_expert_shared=SIZES["ple_shared"], expert_params={"dims": SIZES["expert"]},
                    tower_params_list=towers)
    trainer = MTLTrainer(model, task_types=types, optimizer_params={"lr": args.lr, "weight_decay": 1e-5},
                         n_epoch=args.epochs, device="cpu", model_path=args.scratch)

    train = DataLoader(Dicts(inputs["train"], labels["train"]), batch_size=args.batch, shuffle=True)
    test = DataLoader(Dicts(inputs["test"], labels["test"]), batch_size=4096)
    start = time.perf_counter()
    for _ in range(args.epochs):
        trainer.train_one_epoch(train)
    train_secs = time.perf_counter() - start
    model.eval()
    preds = []
    with torch.no_grad():
        for x, _ in test:
            preds.append(model(x).numpy())
    return train_secs, np.concatenate(preds)


def deepctr(args, meta, inputs, labels, vocab, lengths):
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat
    from deepctr_torch.models.multitask import MMOE, PLE, SharedBottom

    columns = [SparseFeat(c, vocab[c], embedding_dim=args.dim) for c in meta["sparse"]]
    columns += [VarLenSparseFeat(SparseFeat(c, vocab[c], embedding_dim=args.dim), maxlen=lengths[c], combiner="mean")
                for c in meta["multi_hot"]]
    columns += [DenseFeat(c, 1) for c in meta["dense"]]
    n = len(meta["labels"])
    common = dict(task_types=["binary"] * n, task_names=meta["labels"], tower_dnn_hidden_units=SIZES["tower"],
                  seed=args.seed, device="cpu")
    if args.model == "sharedbottom":
        model = SharedBottom(columns, bottom_dnn_hidden_units=SIZES["bottom"], **common)
    elif args.model == "mmoe":
        model = MMOE(columns, num_experts=SIZES["experts"], expert_dnn_hidden_units=SIZES["expert"],
                     gate_dnn_hidden_units=(), **common)
    else:
        model = PLE(columns, shared_expert_num=SIZES["ple_shared"], specific_expert_num=SIZES["ple_specific"],
                    num_levels=1, expert_dnn_hidden_units=SIZES["expert"], gate_dnn_hidden_units=(), **common)
    model.compile(torch.optim.Adam(model.parameters(), lr=args.lr), loss=["binary_crossentropy"] * n)
    start = time.perf_counter()
    model.fit(inputs["train"], labels["train"], batch_size=args.batch, epochs=args.epochs, verbose=0)
    train_secs = time.perf_counter() - start
    return train_secs, model.predict(inputs["test"], batch_size=4096)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", choices=["rechub", "deepctr"], required=True)
    parser.add_argument("--model", choices=["sharedbottom", "mmoe", "ple", "din", "deepfm"], required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scratch", default="/tmp")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    meta, inputs, labels, vocab, lengths = load(args.data)
    single = {"din": (rechub_din, deepctr_din), "deepfm": (rechub_deepfm, deepctr_deepfm)}
    pair = single.get(args.model, (rechub, deepctr))
    run = pair[args.lib == "deepctr"]
    train_secs, preds = run(args, meta, inputs, labels, vocab, lengths)
    rows = len(labels["train"]) * args.epochs
    tasks = {t: {"auc": float(roc_auc_score(labels["test"][:, i], preds[:, i]))} for i, t in enumerate(meta["labels"])}
    print(json.dumps({"lib": args.lib, "model": args.model, "log": meta["log"], "seed": args.seed,
                      "epochs": args.epochs, "train_samples_per_sec": rows / train_secs, "train_secs": train_secs,
                      "wall_secs": time.perf_counter() - wall, "tasks": tasks}))


if __name__ == "__main__":
    main()
