"""bench/scale.py's configurations and what it makes of a run's results: the SSD and
network bytes each configuration should move (the formulas), the figures per
configuration and dtype, the optimizer host's, the notes and the verdicts against the
targets. scale.py launches the ranks and writes the report."""
from __future__ import annotations

import os
import statistics

# name: (ranks, daemons, offload): "<name>o" is "<name>" with attach(offload=True)
CONFIGS = {"n1": (1, 1, False), "n2": (2, 1, False), "n2x2": (2, 2, False), "n4": (4, 1, False),
           "n1o": (1, 1, True), "n2o": (2, 1, True), "n2x2o": (2, 2, True), "n4o": (4, 1, True),
           "n2h": (2, 1, False), "n4h": (4, 1, False), "n2ho": (2, 1, True), "n4ho": (4, 1, True)}
# N workers and one more rank, the optimizer host (serve_optimizer), on the same daemon: the
# workers hold no optimizer state (with "o", no weights between uses either: each block's are
# brought from the optimizer host at each fetch); ranks above counts the workers.
OPTIMIZER_HOST = {"n2h", "n4h", "n2ho", "n4ho"}
TARGET_SSD_TOL, TARGET_STEP_OVER_BOUND, TARGET_EXPOSED = 0.02, 1.15, 0.10


def gathers_per_iter(g: dict, blocks: int, keep: int) -> int:
    """How many times per iteration a layer group's weights are all-gathered on each rank:
    a resident group once (at the barrier, after its step); an offloaded block at each fetch,
    forward's and backward's (the offloader's ``gather``: no barrier gather), except the last
    ``keep`` + 1 blocks, which stay resident from their forward into their backward (offload.py)
    and are fetched by forward only."""
    if not g["offloaded"]:
        return 1
    return 1 if g["offload_index"] >= blocks - 1 - keep else 2


def network_formula(results: list[dict]) -> dict:
    """The bytes each rank's collectives send per iteration, from the layer groups the ranks
    reported: every group's flat gradient reduce-scattered once (on gloo an all-to-all of its
    chunks: (N-1)/N of the padded vector sent per rank, as a ring's), and its weights all-gathered
    ``gathers_per_iter`` times ((N-1)/N of the padded vector each, gloo's ring). Per parameter:
    itemsize x (N-1)/N x sum(padded x (1 + gathers)) / params, i.e. 2 vectors' worth with resident
    weights and 2 + f (B - 1 - keep) / B with B offloaded blocks holding a fraction f of the
    parameters."""
    n, r = len(results), results[0]
    groups, params = r["groups"], r["params"]
    blocks, keep = sum(g["offloaded"] for g in groups), r.get("keep") or 0
    vectors = sum(g["padded"] * (1 + gathers_per_iter(g, blocks, keep)) for g in groups) / params
    itemsize = groups[0]["itemsize"] if groups else 4
    offloaded = sum(g["numel"] for g in groups if g["offloaded"])
    return {"vectors": vectors, "bytes": itemsize * (n - 1) / n * vectors if n > 1 else 0.0,
            "offloaded_params": offloaded, "offloaded_fraction": offloaded / params, "offloaded_blocks": blocks,
            "keep": keep, "fetches_per_iter_formula": sum(gathers_per_iter(g, blocks, keep) for g in groups
                                                          if g["offloaded"])}


STATE_BYTES = {"fp32": 12, "bf16": 8, "int8": 6 + 8 / 256}  # per parameter: fp32 masters and the moments


def ssd_expected(n: int, offloaded_fraction: float, state_rw: float = 24) -> float:
    """SSD bytes per parameter per iteration per rank as designed: the optimizer state (fp32
    masters and two moments) read and written, 24 B, plus for the offloaded blocks' parameters
    4 B: fp32, forward's fetch reads the masters in place (backward's is served from the step's
    read-ahead of the state: no read of its own); bf16, the step writes the 2-byte weights object
    and forward's fetch reads it. Each rank's daemon holds 1/N of it. (``state_rw``: the
    state read and written, 2 x STATE_BYTES of the state dtype: 24 in fp32, 16 in bf16.)"""
    return (state_rw + 4 * offloaded_fraction) / n


def figures(config: str, dtype: str, results: list[dict], disk: dict, tokens_per_rank: int) -> dict:
    """One run's figures from its ranks' JSONs (scale_worker.py)."""
    n_ranks = len(results)
    params, iters = results[0]["params"], len(results[0]["iterations"])
    state_rw = 2 * STATE_BYTES[results[0]["args"].get("state_dtype", "fp32")]
    per = lambda r, a, b: sum(i["t"][b] - i["t"][a] for i in r["iterations"]) / iters  # noqa: E731
    mean = lambda f: statistics.fmean(f(r) for r in results)  # noqa: E731
    iter_s = mean(lambda r: per(r, 0, 4))
    by_daemon: dict[int, list[dict]] = {}
    for r in results:
        by_daemon.setdefault(r["daemon"]["pid"], []).append(r)
    daemons = []
    for pid, rs in by_daemon.items():
        d = rs[0]["delta"]
        pinned = max(s["pinned_used_bytes"] / max(1, s["sessions"]) for r in rs for s in r["pinned"])
        daemons.append({"pid": pid, "ranks": [r["rank"] for r in rs], "bytes_read": d["bytes_read"],
                        "bytes_written": d["bytes_written"], "cpu_s_per_iter": d["daemon_cpu_s"] / iters,
                        "ssd_bytes_per_param_per_iter_per_rank": (d["bytes_read"] + d["bytes_written"])
                        / params / iters / len(rs),
                        "counters_agree_across_ranks": all(r["delta"]["bytes_read"] == d["bytes_read"]
                                                           and r["delta"]["bytes_written"] == d["bytes_written"]
                                                           for r in rs),
                        "pinned_bytes_per_session": pinned,
                        "sessions": max(s["sessions"] for r in rs for s in r["pinned"])})
    read = sum(d["bytes_read"] for d in daemons) / iters
    written = sum(d["bytes_written"] for d in daemons) / iters
    bound = read / (disk["read_gbps"] * 1e9) + written / (disk["durable_write_gbps"] * 1e9)
    cached_bound = read / (disk["read_gbps"] * 1e9) + written / (disk["cached_write_gbps"] * 1e9)
    lo = results[0]["delta"]["lo_tx"]
    tcp = sum(r["delta"]["tcp_sent"] for r in results)
    ratio = (n_ranks - 1) / n_ranks
    formula = network_formula(results)
    calls = lambda kind: mean(lambda r: r["collectives"][kind]["calls"]) / iters  # noqa: E731
    asked = mean(lambda r: sum(r["collectives"][k]["bytes"] for k in ("reduce_scatter", "all_gather",
                                                                       "all_gather_fetch")))
    return {
        "config": config, "dtype": dtype, "offload": CONFIGS[config][2], "ranks": n_ranks,
        "daemons": len(daemons), "params": params,
        "iters": iters, "iter_s": iter_s, "tokens_per_s": n_ranks * tokens_per_rank / iter_s,
        "forward_s": mean(lambda r: per(r, 0, 1)), "backward_s": mean(lambda r: per(r, 1, 2)),
        "step_s": mean(lambda r: per(r, 2, 3)), "zero_grad_s": mean(lambda r: per(r, 3, 4)),
        "exposed_optimizer_fraction": mean(lambda r: per(r, 2, 3) / per(r, 0, 4)),
        "ssd_bytes_per_param_per_iter_per_rank": (read + written) / params / n_ranks,
        "state_rw_bytes_per_param": state_rw,
        "ssd_expected_bytes_per_param_per_iter_per_rank": ssd_expected(
            n_ranks, 0.0 if config in OPTIMIZER_HOST else formula["offloaded_fraction"],
            state_rw),  # (an optimizer host keeps its weights in memory: no fetch reads the SSD)
        "offloaded_params": formula["offloaded_params"], "offloaded_fraction": formula["offloaded_fraction"],
        "offloaded_blocks": formula["offloaded_blocks"],
        "weights_fetched_bytes_per_param_per_iter_per_rank": sum(r["delta"]["fetched_bytes"] for r in results)
        / params / iters / n_ranks,
        "weights_served_bytes_per_param_per_iter_per_rank": sum(r["delta"]["served_bytes"] for r in results)
        / params / iters / n_ranks,
        "ssd_read_bytes_per_iter": read, "ssd_written_bytes_per_iter": written,
        "ssd_bound_s": bound, "step_over_ssd_bound": iter_s / bound,
        "ssd_cached_bound_s": cached_bound, "step_over_ssd_cached_bound": iter_s / cached_bound,
        "network_bytes_per_param_per_iter_per_rank": lo / params / iters / n_ranks,
        "tcp_sent_bytes_per_param_per_iter_per_rank": tcp / params / iters / n_ranks,
        "network_formula_bytes_per_param_per_iter_per_rank": formula["bytes"],
        "network_formula_vectors_per_param": formula["vectors"],
        # (the same collectives on a ring, and as gloo runs them: equal since the reduce-scatter is an all-to-all)
        "network_formula_ring_bytes_per_param_per_iter_per_rank": formula["bytes"],
        "network_formula_gloo_bytes_per_param_per_iter_per_rank": formula["bytes"],
        "network_collectives_bytes_per_param_per_iter_per_rank": ratio * asked / params / iters,
        "reduce_scatters_per_iter": calls("reduce_scatter"), "barrier_gathers_per_iter": calls("all_gather"),
        "fetch_gathers_per_iter": calls("all_gather_fetch"), "fetch_gathers_per_iter_formula":
        formula["fetches_per_iter_formula"] if n_ranks > 1 else 0, "all_reduces_per_iter": calls("all_reduce"),
        "network_target_bytes_per_param_per_iter_per_rank": 6 * ratio,
        "pinned_bytes_per_session": statistics.fmean(d["pinned_bytes_per_session"] for d in daemons),
        "daemon_cpu_s_per_iter": sum(d["cpu_s_per_iter"] for d in daemons),
        **{f"step_{k}_s_per_iter": mean(lambda r, k=k: sum(i[f"{k}_s"] for i in r["iterations"]) / iters)
           for k in ("read", "compute", "write")},
        "per_daemon": daemons, "losses": [[i["loss"] for i in r["iterations"]] for r in results],
        "others_cpus": results[0]["noise"]["others_cpus"], "loadavg_1min": results[0]["noise"]["loadavg_1min"],
        "setup_s": [r["setup_s"] for r in results], "max_rss_bytes": max(r.get("max_rss_bytes", 0) for r in results),
        **optimizer_host_figures(results, read + written, params),
    }


def optimizer_host_figures(results: list[dict], ssd_bytes_per_iter: float, params: int) -> dict:
    """An optimizer-host run's own figures: the SSD bytes all on the optimizer host (target
    24 B/param whatever the number of workers), the resident memory of a worker and of the
    optimizer host, and per worker the network formula of its collectives (what it sends):
    the gradient reduce-scattered among the workers ((N-1)/N of a vector) and its shard to
    the optimizer host (1/N), the weights' all-gather among the workers ((N-1)/N): 2 - 1/N
    vectors resident, and offloaded the all-gather once per fetch instead of once per step
    (the same count as the sharded mode's fetch gathers)."""
    host = results[0].get("optimizer_host")
    if host is None:
        return {"optimizer_host": False}
    itemsize = results[0]["groups"][0]["itemsize"] if results[0]["groups"] else 4
    n = len(results)
    formula = network_formula(results)  # (the sharded mode's: a reduce-scatter and its gathers, of the same groups)
    shards = sum(g["padded"] for g in results[0]["groups"]) / params / n  # (one shard of each, to the host)
    sent = itemsize * ((n - 1) / n * formula["vectors"] + shards)
    return {"optimizer_host": True,
            "optimizer_host_ssd_bytes_per_param_per_iter": ssd_bytes_per_iter / params,
            "optimizer_host_max_rss_bytes": host["max_rss_bytes"],
            # (loopback carries every rank's sends: what the workers' own sockets did not send, the host did)
            "optimizer_host_sent_bytes_per_param_per_iter": (results[0]["delta"]["lo_tx"] - sum(
                r["delta"]["tcp_sent"] for r in results)) / params / len(results[0]["iterations"]),
            "worker_max_rss_bytes": max(r.get("max_rss_bytes", 0) for r in results),
            "optimizer_host_commands": host["served"],
            **{f"network_formula{k}_bytes_per_param_per_iter_per_rank": sent for k in ("", "_ring", "_gloo")}}


def notes(results: dict, bf16: dict) -> list[str]:
    """Why targets are missed, as far as the figures themselves tell."""
    out = []
    for c, m in [*results.items(), *((f"{c}-bf16", f) for c, f in bf16.items())]:
        if m.get("skipped") or m["ranks"] == 1:
            continue
        tcp = m["tcp_sent_bytes_per_param_per_iter_per_rank"]
        formula = m["network_formula_bytes_per_param_per_iter_per_rank"]
        n, target = m["ranks"], m["network_target_bytes_per_param_per_iter_per_rank"]
        vectors = m["network_formula_vectors_per_param"]
        size = formula / ((n - 1) / n) / vectors
        why = (f"{size:.0f}-byte {m['dtype']} vectors: the target's 6 (N-1)/N allows {6 / size:.2f} vectors"
               if formula > target else "within the target")
        what = ("one reduce-scatter, the resident group gathered once and each offloaded block at each fetch"
                if m["offload"] else "one reduce-scatter and one all-gather")
        out.append(f"{c}: the ranks' TCP payload {tcp:.2f} B/param/rank against the formula's {formula:.2f} "
                   f"({what}: {vectors:.3f} flat vectors x "
                   f"(N-1)/N, {why}); the engine's collectives asked for "
                   f"{m['network_collectives_bytes_per_param_per_iter_per_rank']:.2f}; loopback (all processes) "
                   f"{m['network_bytes_per_param_per_iter_per_rank']:.2f}")
    for c, m in [*results.items(), *((f"{c}-bf16", f) for c, f in bf16.items())]:
        if not m.get("skipped") and m["offload"]:
            out.append(f"{c}: SSD {m['ssd_bytes_per_param_per_iter_per_rank']:.2f} B/param/rank, designed "
                       f"{m['ssd_expected_bytes_per_param_per_iter_per_rank']:.2f} = (24 + 4 x "
                       f"{m['offloaded_fraction']:.3f}) / {m['ranks']}: only the {m['offloaded_blocks']} blocks "
                       f"({m['offloaded_fraction']:.1%} of the parameters; the rest group, embeddings and final norm, "
                       f"stays resident) add forward's fetch; the client read "
                       f"{m['weights_fetched_bytes_per_param_per_iter_per_rank']:.2f} B/param/rank of weights "
                       "(forward's "
                       f"fetches and backward's the daemon declined), the daemon served "
                       f"{m['weights_served_bytes_per_param_per_iter_per_rank']:.2f} from its state read-aheads; "
                       f"{m['fetch_gathers_per_iter']:.0f} fetch gathers per iteration "
                       f"(formula {m['fetch_gathers_per_iter_formula']:.0f})")
    for c, m in results.items():
        if not m.get("skipped"):
            cpu = m["daemon_cpu_s_per_iter"]
            out.append(f"{c}: {m['ranks']} rank(s) of 1 thread and {m['daemons']} daemon(s) on {os.cpu_count()} CPUs; "
                       f"the daemons' CPU {cpu:.2f} s per {m['iter_s']:.2f} s iteration; engine.step() waits "
                       f"{m['step_s']:.2f} s of it (reads {m['step_read_s_per_iter']:.2f}, compute "
                       f"{m['step_compute_s_per_iter']:.2f}, write {m['step_write_s_per_iter']:.2f} s summed over "
                       f"groups); SSD bound {m['ssd_bound_s']:.2f} s; other processes of this shared machine used "
                       f"{m['others_cpus']:.2f} of the CPUs meanwhile")
    return out


def judge(name: str, m: dict) -> dict:
    """The issue's targets against one configuration's medians."""
    n, ssd, rw = m["ranks"], m["ssd_bytes_per_param_per_iter_per_rank"], m.get("state_rw_bytes_per_param", 24)
    if CONFIGS[name][2]:  # offloaded weights: at most 28/N (every parameter's weights read once more), within 2%
        ssd_target = (rw + 4) / n
        met = ssd <= (1 + TARGET_SSD_TOL) * ssd_target
    else:  # resident weights: the state's 24/N (16/N in bf16 state), within 2%
        ssd_target = rw / n
        met = abs(ssd - ssd_target) <= TARGET_SSD_TOL * ssd_target
    expected = m["ssd_expected_bytes_per_param_per_iter_per_rank"]
    out = {"ssd_bytes_target": ssd_target, "ssd_bytes_target_kind": "at most" if CONFIGS[name][2] else "equal",
           "ssd_bytes_met": met, "ssd_bytes_expected": expected,
           "ssd_bytes_expected_met": abs(ssd - expected) <= TARGET_SSD_TOL * expected,
           "step_over_ssd_bound_target": TARGET_STEP_OVER_BOUND,
           "step_over_ssd_bound_met": m["step_over_ssd_bound"] <= TARGET_STEP_OVER_BOUND}
    if n > 1:
        out.update(network_target=6 * (n - 1) / n,
                   network_met=m["network_bytes_per_param_per_iter_per_rank"] <= 6 * (n - 1) / n)
    if n == 2:
        out.update(exposed_target=TARGET_EXPOSED, exposed_met=m["exposed_optimizer_fraction"] <= TARGET_EXPOSED)
    return out
