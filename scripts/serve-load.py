#!/usr/bin/env python3
"""Load generator for `sparrow serve` (KServe v2 REST), standard library only.

    scripts/serve-load.py --url http://127.0.0.1:8080 --model NAME --data test.tsv \
        --rows 256 --clients 2 --seconds 10

Sends infer requests of --rows Criteo rows (taken in turn from --data) from
--clients threads, each on one keep-alive connection, and prints one JSON
line: requests/s, rows/s, p50/p99 latency in ms, and non-200 answers.
Python's client costs CPU too: on a small machine it shares the cores with the
server, so read the figures as a floor.
"""
import argparse, http.client, json, threading, time, urllib.parse


def criteo_inputs(lines):
    rows = [l.rstrip("\n").split("\t") for l in lines]
    cell = lambda r, i: r[i] if i < len(r) else ""
    inputs = [{"name": f"I{i+1}", "datatype": "FP32", "shape": [len(rows)],
               "data": [float(cell(r, 1 + i)) if cell(r, 1 + i) else None for r in rows]} for i in range(13)]
    inputs += [{"name": f"C{i+1}", "datatype": "BYTES", "shape": [len(rows)],
                "data": [cell(r, 14 + i) for r in rows]} for i in range(26)]
    return json.dumps({"inputs": inputs}).encode()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10)
    a = p.parse_args()
    lines = open(a.data).read().splitlines()[: max(a.rows * 64, a.rows)]
    bodies = [criteo_inputs(lines[i:i + a.rows]) for i in range(0, len(lines) - a.rows + 1, a.rows)][:64]
    url = urllib.parse.urlparse(a.url)
    path = f"/v2/models/{a.model}/infer"
    latencies, failures, lock = [], [0], threading.Lock()
    end = time.monotonic() + a.seconds

    def client(k):
        conn = http.client.HTTPConnection(url.hostname, url.port)
        mine, bad, i = [], 0, k
        while time.monotonic() < end:
            t = time.monotonic()
            conn.request("POST", path, bodies[i % len(bodies)], {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            mine.append(time.monotonic() - t)
            bad += r.status != 200
            i += 1
        with lock:
            latencies.extend(mine)
            failures[0] += bad

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.monotonic() - start
    latencies.sort()
    q = lambda f: round(1000 * latencies[min(len(latencies) - 1, int(f * len(latencies)))], 3)
    print(json.dumps({"rows_per_request": a.rows, "clients": a.clients, "requests": len(latencies),
                      "requests_per_sec": round(len(latencies) / wall, 1),
                      "rows_per_sec": round(len(latencies) * a.rows / wall, 1),
                      "p50_ms": q(0.5), "p99_ms": q(0.99), "non_200": failures[0]}))


if __name__ == "__main__":
    main()
