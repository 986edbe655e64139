#!/usr/bin/env python3
"""The peer of issue 41's models: ESMM, MMoE, PLE and DIN written the standard way
in PyTorch, trained on the same `sparrow gen --tasks --sequence` CSV as
Sparrow, with the same hyperparameters as the Sparrow config scripts/bench-tasks
writes beside it.

- Inputs: user_id, item_id, item_category, site (one embedding table each,
  `--dim` wide, every ID of the training file a row of its own, unseen test IDs
  one shared row), the history `hist_items` (the newest `--max-len` IDs, in
  the item table: history and candidate share vectors), price as log(1 + x).
- Embeddings: U(-0.01, 0.01), Adagrad (lr 0.05, eps 1e-8) on sparse
  gradients; dense layers: PyTorch's default init, Adam (lr 0.001).
- `esmm`: a CTR and a CVR tower (`--tower-hidden`) on the concatenated inputs
  (the history sum-pooled); the conversion output is pCTR x pCVR.
- `mmoe`: `--experts` experts (MLPs of `--expert-hidden`, ReLU), a softmax
  gate and a tower per task.
- `ple`: `--levels` extraction levels of `--experts` shared and
  `--task-experts` experts per task; a task's gate mixes its own and the
  shared experts of its input, and below the top a shared gate mixes them
  all into the next level's shared input; a tower per task.
- `din`: a local activation unit (MLP `--attention-hidden` -> 1 on
  [q, k, q-k, q*k]) scores each history item against the candidate item; the
  history is the scores' weighted sum (unnormalised, padding masked); an MLP
  of `--hidden` on everything.
- Loss: the sum over tasks of weight x mean over the batch's rows (a masked
  label, an empty cell, adds nothing); multiclass tasks softmax cross-entropy.

Data are parsed and turned into tensors before the clock starts: the timed
part is the training loop alone (the peer's best case). Prints one JSON line:
samples/s of the loop, and each task's test AUC (macro one-vs-rest AUC for a
multiclass task).
"""

import argparse
import json
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

TABLES = ["user_id", "item_id", "item_category", "site"]


def auc(scores, labels):
    """Rank AUC, ties averaged."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2 + 1
        i = j + 1
    pos = y.sum()
    neg = len(y) - pos
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def load(train_path, test_path, tasks, max_len):
    train = pd.read_csv(train_path, dtype=str, keep_default_na=False)
    test = pd.read_csv(test_path, dtype=str, keep_default_na=False)
    vocab = {}
    for t in TABLES:
        ids = pd.unique(train[t]) if t != "item_id" else pd.unique(
            np.concatenate([train[t].to_numpy(), np.concatenate(train["hist_items"].str.split("|").to_numpy())]))
        vocab[t] = {v: i + 1 for i, v in enumerate(v for v in ids if v != "")}  # 0: unseen

    def tensors(frame):
        cols = [torch.tensor([vocab[t].get(v, 0) for v in frame[t]], dtype=torch.long) for t in TABLES]
        hist = [[vocab["item_id"].get(v, 0) for v in s.split("|") if v][-max_len:] for s in frame["hist_items"]]
        lengths = torch.tensor([len(h) for h in hist], dtype=torch.long)
        padded = torch.zeros((len(hist), max_len), dtype=torch.long)
        for r, h in enumerate(hist):
            padded[r, : len(h)] = torch.tensor(h, dtype=torch.long)
        price = torch.tensor(np.log1p(frame["price"].astype(np.float64).to_numpy()), dtype=torch.float32)[:, None]
        labels = torch.tensor(
            np.stack([frame[name].replace("", "nan").astype(np.float64).to_numpy() for name, _, _ in tasks], 1),
            dtype=torch.float32,
        )
        return cols, padded, lengths, price, labels

    return vocab, tensors(train), tensors(test)


def mlp(sizes, relu_last):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if relu_last or i + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Model(nn.Module):
    def __init__(self, args, vocab, tasks):
        super().__init__()
        d = args.dim
        self.kind, self.tasks = args.model, tasks
        self.tables = nn.ModuleList([nn.Embedding(len(vocab[t]) + 1, d, sparse=True) for t in TABLES])
        for e in self.tables:
            nn.init.uniform_(e.weight, -0.01, 0.01)
        x = (len(TABLES) + 1) * d + 1
        outputs = [k for _, _, k in tasks]
        if self.kind == "esmm":
            self.towers = nn.ModuleList([mlp([x] + args.tower_hidden + [1], False) for _ in range(2)])
        elif self.kind == "mmoe":
            width = args.expert_hidden[-1]
            self.experts = nn.ModuleList([mlp([x] + args.expert_hidden, True) for _ in range(args.experts)])
            self.gates = nn.ModuleList([nn.Linear(x, args.experts) for _ in tasks])
            self.towers = nn.ModuleList([mlp([width] + args.tower_hidden + [k], False) for k in outputs])
        elif self.kind == "ple":
            width, fan_in, n = args.expert_hidden[-1], x, len(tasks)
            self.levels = nn.ModuleList()
            for level in range(args.levels):
                lv = nn.Module()
                lv.shared = nn.ModuleList([mlp([fan_in] + args.expert_hidden, True) for _ in range(args.experts)])
                lv.own = nn.ModuleList([nn.ModuleList([mlp([fan_in] + args.expert_hidden, True)
                                                       for _ in range(args.task_experts)]) for _ in tasks])
                lv.gates = nn.ModuleList([nn.Linear(fan_in, args.task_experts + args.experts) for _ in tasks])
                top = level + 1 == args.levels
                lv.shared_gate = None if top else nn.Linear(fan_in, args.experts + n * args.task_experts)
                self.levels.append(lv)
                fan_in = width
            self.towers = nn.ModuleList([mlp([width] + args.tower_hidden + [k], False) for k in outputs])
        else:
            self.attention = mlp([4 * d] + args.attention_hidden + [1], False)
            self.mlp = mlp([x] + args.hidden + [sum(outputs)], False)

    def forward(self, cols, hist, lengths, price):
        fields = [e(c) for e, c in zip(self.tables, cols)]
        items = self.tables[1](hist)  # [B, L, d], history shares the item table
        mask = (torch.arange(hist.shape[1])[None, :] < lengths[:, None]).float()[:, :, None]
        if self.kind == "din":
            q = fields[1][:, None, :].expand_as(items)
            score = self.attention(torch.cat([q, items, q - items, q * items], -1))
            pooled = (score * items * mask).sum(1)
        else:
            pooled = (items * mask).sum(1)
        x = torch.cat(fields + [pooled, price], 1)
        if self.kind == "esmm":
            a, b = self.towers[0](x), self.towers[1](x)
            ctcvr = -torch.logsumexp(torch.cat([-a, -b, -a - b], 1), 1, keepdim=True)
            return torch.cat([a, ctcvr], 1)
        if self.kind == "mmoe":
            experts = torch.stack([e(x) for e in self.experts], 1)  # [B, E, H]
            outs = []
            for gate, tower in zip(self.gates, self.towers):
                w = torch.softmax(gate(x), -1)[:, :, None]
                outs.append(tower((experts * w).sum(1)))
            return torch.cat(outs, 1)
        if self.kind == "ple":
            inputs, shared_in = [x] * len(self.towers), x
            for lv in self.levels:
                shared = [e(shared_in) for e in lv.shared]
                own = [[e(i) for e in es] for es, i in zip(lv.own, inputs)]
                mixed = []
                for t, gate in enumerate(lv.gates):
                    w = torch.softmax(gate(inputs[t]), -1)[:, :, None]
                    mixed.append((torch.stack(own[t] + shared, 1) * w).sum(1))
                if lv.shared_gate is not None:
                    w = torch.softmax(lv.shared_gate(shared_in), -1)[:, :, None]
                    shared_in = (torch.stack(shared + [e for o in own for e in o], 1) * w).sum(1)
                inputs = mixed
            return torch.cat([tower(i) for tower, i in zip(self.towers, inputs)], 1)
        return self.mlp(x)


def loss_of(logits, labels, tasks):
    total, at, rows = 0.0, 0, labels.shape[0]
    for t, (_, weight, k) in enumerate(tasks):
        y = labels[:, t]
        seen = ~torch.isnan(y)
        if k == 1:
            per_row = F.binary_cross_entropy_with_logits(logits[:, at], torch.nan_to_num(y), reduction="none")
        else:
            per_row = F.cross_entropy(logits[:, at : at + k], torch.nan_to_num(y).long(), reduction="none")
        total = total + weight * (per_row * seen).sum() / rows
        at += k
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--model", choices=["esmm", "mmoe", "ple", "din"], required=True)
    p.add_argument("--tasks", default="click:1:1,conversion:2:1,ad_type:0.5:4",
                   help="name:weight:outputs, comma-separated (outputs > 1: multiclass)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[64, 32])
    p.add_argument("--tower-hidden", type=lambda s: [int(v) for v in s.split(",")], default=[32])
    p.add_argument("--expert-hidden", type=lambda s: [int(v) for v in s.split(",")], default=[64])
    p.add_argument("--attention-hidden", type=lambda s: [int(v) for v in s.split(",")], default=[36])
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--task-experts", type=int, default=1)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tasks = [(n, float(w), int(k)) for n, w, k in (t.split(":") for t in args.tasks.split(","))]
    vocab, train, test = load(args.train, args.test, tasks, args.max_len)
    model = Model(args, vocab, tasks)
    sparse = [e.weight for e in model.tables]
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opt_sparse = torch.optim.Adagrad(sparse, lr=0.05, eps=1e-8)
    opt_dense = torch.optim.Adam(dense, lr=0.001)
    cols, hist, lengths, price, labels = train
    rows = labels.shape[0]
    start = time.perf_counter()
    for _ in range(args.epochs):
        for s in range(0, rows, args.batch_size):
            e = min(s + args.batch_size, rows)
            logits = model([c[s:e] for c in cols], hist[s:e], lengths[s:e], price[s:e])
            loss = loss_of(logits, labels[s:e], tasks)
            opt_sparse.zero_grad()
            opt_dense.zero_grad()
            loss.backward()
            opt_sparse.step()
            opt_dense.step()
    train_secs = time.perf_counter() - start
    with torch.no_grad():
        cols, hist, lengths, price, labels = test
        logits = torch.cat([model([c[s:s + 4096] for c in cols], hist[s:s + 4096], lengths[s:s + 4096],
                                  price[s:s + 4096]) for s in range(0, labels.shape[0], 4096)])
    figures, at = {}, 0
    for t, (name, _, k) in enumerate(tasks):
        y = labels[:, t].numpy()
        seen = ~np.isnan(y)
        if k == 1:
            figures[name] = {"auc": auc(logits[:, at].numpy()[seen], y[seen].astype(np.int64))}
        else:
            probs = torch.softmax(logits[:, at : at + k], 1).numpy()[seen]
            cls = y[seen].astype(np.int64)
            figures[name] = {"macro_auc": float(np.mean([auc(probs[:, c], (cls == c).astype(np.int64))
                                                         for c in range(k) if 0 < (cls == c).sum() < len(cls)]))}
        at += k
    print(json.dumps({"peer": "pytorch", "model": args.model, "torch": torch.__version__,
                      "samples_per_sec": rows * args.epochs / train_secs, "train_secs": train_secs,
                      "tasks": figures}))


if __name__ == "__main__":
    main()
