#!/usr/bin/env python3
"""Load generator for `sparrow serve` (KServe v2 REST), standard library only.

    scripts/serve-load.py --url http://127.0.0.1:8080 --model NAME --data test.tsv \
        --rows 256 --clients 2 --seconds 10

Sends infer requests of --rows Criteo rows (taken in turn from --data) from
--clients threads, each on one keep-alive connection, and prints one JSON
line: requests/s, rows/s, p50/p99 latency in ms, and non-200 answers.
Against `sparrow serve --watch`, it also counts the model versions the
answers came from, and gives requests/s and p99 within 250 ms of each
version change (a swap) beside the figures away from swaps.
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

    done = []  # (finished at, latency, model version) of every answer

    def client(k):
        conn = http.client.HTTPConnection(url.hostname, url.port)
        mine, bad, i = [], 0, k
        while time.monotonic() < end:
            t = time.monotonic()
            conn.request("POST", path, bodies[i % len(bodies)], {"Content-Type": "application/json"})
            r = conn.getresponse()
            body = r.read()
            now = time.monotonic()
            version = json.loads(body).get("model_version") if r.status == 200 else None
            mine.append((now, now - t, version))
            bad += r.status != 200
            i += 1
        with lock:
            done.extend(mine)
            failures[0] += bad

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.monotonic() - start
    done.sort()
    latencies = sorted(d[1] for d in done)

    def q(values, f):
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(f * len(values)))], 3) if values else None

    report = {"rows_per_request": a.rows, "clients": a.clients, "requests": len(latencies),
              "requests_per_sec": round(len(latencies) / wall, 1),
              "rows_per_sec": round(len(latencies) * a.rows / wall, 1),
              "p50_ms": q(latencies, 0.5), "p99_ms": q(latencies, 0.99), "non_200": failures[0]}
    # Swaps: where the answering model's version changes (answers in finishing order).
    versions = [d[2] for d in done if d[2] is not None]
    swaps = [done[i][0] for i in range(1, len(done))
             if done[i][2] is not None and done[i - 1][2] is not None and done[i][2] != done[i - 1][2]]
    if len(set(versions)) > 1:
        near = [d for d in done if any(abs(d[0] - s) <= 0.25 for s in swaps)]
        away = [d for d in done if all(abs(d[0] - s) > 0.25 for s in swaps)]
        # The windows' union, clipped to the run: what near-swap requests/s divides by.
        near_secs, reach = 0.0, start
        for s in swaps:
            lo, hi = max(s - 0.25, reach, start), min(s + 0.25, start + wall)
            near_secs += max(0.0, hi - lo)
            reach = max(reach, hi)
        near_secs = max(near_secs, 1e-9)
        report.update({"versions_seen": len(set(versions)), "swaps_seen": len(swaps),
                       "requests_per_sec_near_swaps": round(len(near) / near_secs, 1),
                       "requests_per_sec_away": round(len(away) / max(wall - near_secs, 1e-9), 1),
                       "p99_ms_near_swaps": q([d[1] for d in near], 0.99),
                       "p99_ms_away": q([d[1] for d in away], 0.99)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
