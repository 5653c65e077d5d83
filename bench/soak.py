"""Soak: a toy sampler under consumers, config changes, weight pushes and a kill -9.

N consumers (half on the stream, half leasing; all acking), a PATCH every few seconds,
a weight push every 15 s and, a third of the way in, a SIGKILL of the server and a restart on the
same state dir. Reports groups, duplicates, 5xx answers, groups lost across the restart,
and the server's memory and state-dir size over time.

    .venv/bin/python -m bench.soak --quick       # ~5 minutes
    .venv/bin/python -m bench.soak --duration-s 1800

Definitions. received: distinct group ids any consumer got. duplicates: deliveries of a
group id to a second consumer while the first had not acked it, outside a restart (two
live consumers holding one group). lost: groups delivered but not acked when the server
was killed that never came back (redelivered, or left in the queue at the end).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import table, write_json
from trainer_client.client import SamplerClient
from trainer_client.exceptions import SamplerError
from trainer_client.launch import SamplerProcess

# Consumers ack without training or pushing weights: nothing to bound.
CONFIG = {
    "stopping": "wave",  # as the committed figures were measured
    "max_tokens": 8,
    "max_active_prompts": 16,
    "max_buffered_groups": 64,
    "max_staleness": None,
}
PATCHES = [
    {"temperature": 0.9},
    {"max_active_prompts": 24},
    {"temperature": 1.0},
    {"max_active_prompts": 16},
]


class Ledger:
    """What every consumer received and acked, shared by the consumer threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: dict[str, str] = {}  # group id -> consumer holding it unacked
        self.received: set[str] = set()
        self.acked: set[str] = set()
        self.after_restart: set[str] = set()
        self.duplicates = 0
        self.server_errors = 0
        self.restarted = False

    def got(self, consumer: str, group_id: str) -> None:
        with self.lock:
            other = self.holder.get(group_id)
            if other is not None and other != consumer:
                self.duplicates += 1
            self.holder[group_id] = consumer
            self.received.add(group_id)
            if self.restarted:
                self.after_restart.add(group_id)

    def done(self, group_id: str) -> None:
        with self.lock:
            self.holder.pop(group_id, None)
            self.acked.add(group_id)

    def restart(self) -> set[str]:
        """The server was killed: what was held unacked is forgotten (it must come back)."""
        with self.lock:
            held, self.holder = set(self.holder), {}
            self.restarted = True
            return held


def _stream_consumer(url: str, name: str, ledger: Ledger, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with SamplerClient(url, consumer=name, watchdog_s=120, heartbeat_s=1.0) as client:
                for group in client.groups():
                    ledger.got(name, group.group_id)
                    client.ack([group])
                    ledger.done(group.group_id)
                    if stop.is_set():
                        return
        except SamplerError as exc:
            if getattr(exc, "status", 0) >= 500:
                ledger.server_errors += 1
            time.sleep(1.0)


def _lease_consumer(url: str, name: str, ledger: Ledger, stop: threading.Event) -> None:
    with SamplerClient(url, consumer=name, watchdog_s=120) as client:
        while not stop.is_set():
            try:
                lease = client.lease(max_groups=4, wait_s=1.0)
                for group in lease.groups:
                    ledger.got(name, group.group_id)
                if lease.groups:
                    client.ack(lease.groups)
                    for group in lease.groups:
                        ledger.done(group.group_id)
            except SamplerError as exc:
                if getattr(exc, "status", 0) >= 500:
                    ledger.server_errors += 1
                time.sleep(1.0)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _engine_pid(http: httpx.Client, url: str) -> int:
    try:
        return int(http.get(f"{url}/v1/stats").json()["engine"].get("engine_pid") or 0)
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _weights(model_dir: Path, step: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(step)
    return {
        k: v.detach() + 1e-4 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trainer_client.toy import build_toy

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    toy = build_toy(work / "toy", seed=0)
    state = work / "state"
    server = SamplerProcess(
        toy.model_dir, toy.data_files, state, CONFIG, work / "server.log", heartbeat_s=1.0
    )
    url = server.start()
    # The restart must come back on the same port: the consumers keep their URL.
    server.cmd[server.cmd.index("--port") + 1] = url.rsplit(":", 1)[1]
    ledger, stop = Ledger(), threading.Event()
    threads = [
        threading.Thread(
            target=_stream_consumer if i % 2 == 0 else _lease_consumer,
            args=(url, f"soak-{'stream' if i % 2 == 0 else 'lease'}-{i}", ledger, stop),
            daemon=True,
        )
        for i in range(args.consumers)
    ]
    for t in threads:
        t.start()
    http = httpx.Client(timeout=120)
    timeline: list[dict[str, Any]] = []
    patches, pushes, version = itertools.cycle(PATCHES), 0, 0
    lost_watch: set[str] = set()
    started = time.monotonic()
    next_patch = next_push = next_sample = started
    killed = False
    weights = _weights(toy.model_dir, 0)
    while (now := time.monotonic()) - started < args.duration_s:
        if args.kill and not killed and now - started >= args.duration_s / 3:
            server.kill()
            lost_watch = ledger.restart()
            url = server.start()
            killed = True
            version = http.get(f"{url}/health").json()["policy_version"]
        if now >= next_patch:
            r = http.patch(f"{url}/v1/config", json=next(patches))
            ledger.server_errors += r.status_code >= 500
            next_patch = now + args.patch_every_s
        if now >= next_push:
            version += 1
            with SamplerClient(url) as client:
                try:
                    client.push_weights(weights, version)
                    pushes += 1
                except SamplerError as exc:
                    ledger.server_errors += getattr(exc, "status", 0) >= 500
            next_push = now + args.push_every_s
        if now >= next_sample:
            timeline.append(
                {
                    "t_s": round(now - started),
                    "received": len(ledger.received),
                    "server_rss_mb": round(_rss_mb(server.pid), 1),
                    "engine_rss_mb": round(_rss_mb(_engine_pid(http, url)), 1),
                    "state_dir_mb": round(_dir_mb(state), 2),
                }
            )
            next_sample = now + args.sample_every_s
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    # What is still queued counts as not lost: drain it.
    remaining: set[str] = set()
    with SamplerClient(url, consumer="soak-drain") as client:
        while groups := client.lease(max_groups=64, wait_s=0.0).groups:
            remaining.update(g.group_id for g in groups)
            client.ack(groups)
    server.stop()
    lost = lost_watch - ledger.after_restart - remaining
    return {
        "duration_s": args.duration_s,
        "consumers": args.consumers,
        "groups_received": len(ledger.received),
        "groups_acked": len(ledger.acked),
        "duplicates": ledger.duplicates,
        "server_errors_5xx": ledger.server_errors,
        "unacked_at_kill": len(lost_watch),
        "lost": len(lost),
        "weight_pushes": pushes,
        "killed_and_restarted": killed,
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 minutes of load (~5 in all)")
    p.add_argument("--duration-s", type=float, default=None, help="load time [1800; quick 240]")
    p.add_argument("--consumers", type=int, default=4, help="half stream, half lease")
    p.add_argument("--patch-every-s", type=float, default=5.0)
    p.add_argument("--push-every-s", type=float, default=15.0)
    p.add_argument("--sample-every-s", type=float, default=20.0)
    p.add_argument("--no-kill", dest="kill", action="store_false", help="no kill -9 mid-run")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s or (240.0 if args.quick else 1800.0)
    result = run(args)
    print(
        table(
            [result],
            [
                ("groups_received", "received"),
                ("groups_acked", "acked"),
                ("duplicates", "duplicates"),
                ("server_errors_5xx", "5xx"),
                ("unacked_at_kill", "unacked at kill"),
                ("lost", "lost"),
                ("weight_pushes", "weight pushes"),
            ],
        )
    )
    print(
        table(
            result["timeline"],
            [
                ("t_s", "t (s)"),
                ("received", "received"),
                ("server_rss_mb", "server RSS (MB)"),
                ("engine_rss_mb", "engine RSS (MB)"),
                ("state_dir_mb", "state dir (MB)"),
            ],
        )
    )
    write_json("soak", {"args": vars(args), **result})
    return result


if __name__ == "__main__":
    main()
