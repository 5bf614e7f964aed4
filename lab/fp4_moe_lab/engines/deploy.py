# SPDX-License-Identifier: Apache-2.0
"""Deployments of vLLM's OpenAI server the way operators start them, several processes at a time,
in a network namespace of their own whose only interface is loopback.

Scenarios (``SCENARIOS``): the Ray executor (a Ray cluster started first with ``ray start``, as
on a real cluster), data parallel with one API server per rank, a head plus a ``--headless``
engine, several API servers, the Ray data-parallel backend, a compiled (not eager) engine,
pipeline parallel with a first stage of dense layers, ranks that do not load the plugin, and the
mixed fleets that must refuse to serve. Each returns what a test asserts on: greedy tokens
from every API server, every process's exit status, and the combined log.

Why a network namespace: Ray's servers bind every interface whatever ``--node-ip-address``
says (0.0.0.0 is compiled into its GCS and raylet), so the only way to keep a test cluster off
the machine's network is a namespace with nothing but ``lo``. :func:`run` re-executes this module
under ``unshare --net`` (root, as the tests run here and in CI); inside, Ray picks 127.0.0.1
(no route to anywhere else) and the driver checks that it did.

Standard library only, like ``server.py``; the engine worlds' pythons run the servers. It needs
a checkout's ``.venv-engine*``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fp4_moe_lab.engines import server

PROMPTS = [[1, 5, 9, 33, 100, 7, 250, 3], [2, 40, 41, 42, 300, 17]]
MAX_TOKENS = 6
ACTIVE = "vllm-fp4-moe-plugin active"
FLEET_OK = "vllm-fp4-moe-plugin fleet check: all"
FLEET_ERRORS = ("FleetMismatchError", "FleetIncompleteError")
# The ERROR line a rank's fleet check logs before it raises (vLLM's "[file:line] " precedes
# it; the tracebacks other processes print on the way out have "...Error: " instead).
FLEET_REFUSED = "] vllm-fp4-moe-plugin fleet check refused:"
# Per world, what selects the FlashInfer CUTLASS NVFP4 MoE path the seam emulates: 0.11.0 by
# environment (as engine_run.py), 0.32.0 by flag (test_engine32_e2e.py).
WORLD_ENV = {"0.11.0": {"VLLM_USE_FLASHINFER_MOE_FP4": "1",
                        "VLLM_FLASHINFER_MOE_BACKEND": "throughput", "VLLM_MLA_DISABLE": "1"},
             "0.32.0": {}}
WORLD_ARGS = {"0.11.0": (), "0.32.0": ("--moe-backend", "flashinfer_cutlass")}
# vLLM 0.11.0's log format has no pid (its process prefixes come from stdout decoration, which
# a worker's first lines precede): this vLLM logging config puts the record's own pid on every
# line, so lines can be counted per process. 0.32.0's own format already has it.
LOGGING_CONFIG = {
    "formatters": {"vllm": {"class": "vllm.logging_utils.NewLineFormatter",
                            "datefmt": "%m-%d %H:%M:%S",
                            "format": "(pid=%(process)d) %(levelname)s %(asctime)s "
                                      "[%(fileinfo)s:%(lineno)d] %(message)s"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm",
                          "level": "INFO", "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "DEBUG", "propagate": False}},
    "version": 1, "disable_existing_loggers": False}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc


def launch(name: str, cmd: list, env: dict, log_dir: Path) -> Proc:
    """Start ``cmd`` in its own session (so its whole process tree can be stopped)."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 cwd=str(log_dir), start_new_session=True)
    return Proc(name, popen, log_path)


def stop(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=10)
        p.poll()


def wait_ready(urls: list, procs: list, timeout_s: float) -> float:
    """Seconds until every URL answers; RuntimeError if a process exits first or time runs out."""
    t0 = time.monotonic()
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not server._ready(u)]
        if not pending:
            break
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited ({dead[0].popen.returncode}) before the "
                               "deployment was ready")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {pending}")
        time.sleep(2.0)
    return time.monotonic() - t0


def wait_exit(procs: list, timeout_s: float, markers: tuple = ()) -> float | None:
    """Wait until every process has exited (a refused deployment must end by itself); returns
    when one of ``markers`` first appeared in a process's log (seconds since the first start),
    to time how long the processes took to end after it."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        if seen is None and any(m in p.log() for p in procs for m in markers):
            seen = time.monotonic()
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    return None if seen is None else seen - procs[0].started


def leftover_processes(procs: list, grace_s: float = 10.0) -> list[str]:
    """Processes still alive in the sessions the deployment started (none must outlive it),
    after ``grace_s`` for the ones already dying."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = _alive_in_sessions({p.popen.pid for p in procs})
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _alive_in_sessions(sids: set) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) in sids:  # field 6 of stat: the session id
            out.append(f"{d.name} {stat.split('(', 1)[1].split(')')[0]}")
    return out


# -- Ray ------------------------------------------------------------------------------------

@contextlib.contextmanager
def ray_cluster(python: Path, env: dict, log_dir: Path, num_gpus: int):
    """A one-node Ray cluster started as an operator starts one (``ray start --head``), with
    ``env`` as that node's environment (what its Ray workers inherit), bound to loopback."""
    ray = str(Path(python).parent / "ray")
    port = server.free_port()
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    out = subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1",
                          f"--port={port}", f"--num-gpus={num_gpus}", "--num-cpus=4",
                          "--include-dashboard=false", "--disable-usage-stats"],
                         env=env, cwd=str(log_dir), capture_output=True, text=True, timeout=180)
    (log_dir / "ray-start.log").write_text(out.stdout + out.stderr)
    try:
        if out.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        ip = re.search(r"Local node IP: (\S+)", out.stdout + out.stderr)
        if ip is None or ip.group(1) != "127.0.0.1":
            raise RuntimeError(f"Ray picked {ip and ip.group(1)}, not loopback")
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


# -- scenarios --------------------------------------------------------------------------

def _env(args, plugin: str = "1", omp_bind: str | None = None, **extra) -> dict:
    env = server.engine_env(plugin=plugin, kernel=args.kernel, omp_bind=omp_bind)
    if plugin == "unset":
        env.pop("VLLM_FP4_MOE_PLUGIN")
    env.update({"VLLM_HOST_IP": "127.0.0.1", **WORLD_ENV[args.world], **extra})
    if args.world == "0.11.0":
        config = Path(args.log_dir) / "logging.json"
        config.write_text(json.dumps(LOGGING_CONFIG))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    return env


def _cmd(args, port, **kw):
    """``vllm serve`` as an operator types it (the CLI: several API servers and headless
    engines exist only there). Token-id prompts need no tokenizer; text prompts do."""
    extra = ((() if args.text_prompts else ("--skip-tokenizer-init",)) + WORLD_ARGS[args.world]
             + tuple(kw.pop("extra_args", ())))
    return server.server_command(args.python, args.model, port, extra_args=extra, cli=True, **kw)


def _serve(args, log_dir, specs, urls, expect_refusal=False) -> dict:
    """Start ``specs`` (name, cmd, env), then either query every URL (tokens) or, with
    ``expect_refusal`` (or offline runs), wait for every process to exit by itself."""
    procs = []
    result: dict = {"ready_s": None, "tokens": {}, "exit": {}, "leftover": []}
    try:
        for name, cmd, env in specs:
            procs.append(launch(name, cmd, env, log_dir))
        if expect_refusal:
            result["refused_s"] = wait_exit(procs, args.timeout, markers=FLEET_ERRORS)
        else:
            result["ready_s"] = wait_ready(urls, procs, args.timeout)
            prompts = json.loads(args.text_prompts) if args.text_prompts else PROMPTS
            for url in urls:
                result["tokens"][url] = server.greedy(url, prompts, args.max_tokens)
    except RuntimeError as exc:
        result["error"] = str(exc)
    finally:
        # each process: (exit status, seconds from the first start to its exit)
        result["exit"] = {p.name: (p.poll(), None if p.ended is None
                                   else round(p.ended - procs[0].started, 1)) for p in procs}
        # a refused deployment must have ended all by itself; a served one once stopped
        result["leftover"] = leftover_processes(procs) if expect_refusal else []
        stop(procs)
        result["leftover"] += leftover_processes(procs)
        result["log"] = "\n".join(f"===== {p.name}\n{p.log()}" for p in procs)
    return result


def single(args, log_dir, tp=1, dp=1, ep=False, eager=True, extra_args=(),
           extra_env=None) -> dict:
    """One ``vllm serve`` (the one-command run every other deployment is compared with)."""
    port = server.free_port()
    bind = "|".join(str(i % 2) for i in range(tp * dp)) if tp * dp > 1 else None
    env = _env(args, omp_bind=bind, **(extra_env or {}))
    if not eager:  # the compiled path: let torch.compile run, the MoE opaque as on CUDA
        env.pop("TORCHDYNAMO_DISABLE", None)
        env["FP4_MOE_TEST_MOE_OP"] = "1"
    cmd = _cmd(args, port, tp=tp, dp=dp, ep=ep, eager=eager, extra_args=extra_args)
    return _serve(args, log_dir, [("server", cmd, env)], [f"http://127.0.0.1:{port}"])


def ray_tp2(args, log_dir, node_switch: str | None = None) -> dict:
    """TP=2 on vLLM's Ray executor, the switch set only where `vllm serve` runs; with
    ``node_switch``, the Ray node was started with ``VLLM_FP4_MOE_PLUGIN=node_switch``."""
    node_env = _env(args, plugin="unset", omp_bind="0|1", FP4_MOE_TEST_EXECUTOR="1")
    if node_switch is not None:
        node_env["VLLM_FP4_MOE_PLUGIN"] = node_switch
    with ray_cluster(args.python, node_env, log_dir, num_gpus=2) as address:
        port = server.free_port()
        env = _env(args, omp_bind="0|1", FP4_MOE_TEST_EXECUTOR="1", RAY_ADDRESS=address,
                   RAY_DEDUP_LOGS="0")  # the driver prints every worker's lines
        cmd = _cmd(args, port, tp=2, extra_args=("--distributed-executor-backend", "ray"))
        return _serve(args, log_dir, [("server", cmd, env)], [f"http://127.0.0.1:{port}"],
                      expect_refusal=node_switch is not None)


def ray_dp2_ep(args, log_dir) -> dict:
    """DP=2 + EP with vLLM's Ray data-parallel backend (engine cores are Ray actors)."""
    node_env = _env(args, plugin="unset", omp_bind="0|1", FP4_MOE_TEST_EXECUTOR="1")
    with ray_cluster(args.python, node_env, log_dir, num_gpus=2) as address:
        port = server.free_port()
        env = _env(args, omp_bind="0|1", FP4_MOE_TEST_EXECUTOR="1", RAY_ADDRESS=address,
                   RAY_DEDUP_LOGS="0")
        cmd = _cmd(args, port, dp=2, ep=True, extra_args=(
            "--data-parallel-backend", "ray", "--data-parallel-address", "127.0.0.1"))
        return _serve(args, log_dir, [("server", cmd, env)], [f"http://127.0.0.1:{port}"])


def dp2_ep_per_rank(args, log_dir, rank1_switch: str = "1") -> dict:
    """DP=2 + EP, one API server per rank (external load balancing, `--data-parallel-rank`);
    ``rank1_switch`` "unset" or "0": rank 1's node lacks the switch (a mixed fleet)."""
    rpc = str(server.free_port())
    specs, urls = [], []
    for rank, switch in ((0, "1"), (1, rank1_switch)):
        port = server.free_port()
        env = _env(args, plugin=switch, omp_bind=str(rank))
        cmd = _cmd(args, port, dp=2, ep=True, extra_args=(
            "--data-parallel-rank", str(rank), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", rpc))
        specs.append((f"rank{rank}", cmd, env))
        urls.append(f"http://127.0.0.1:{port}")
    return _serve(args, log_dir, specs, urls, expect_refusal=rank1_switch != "1")


def dp2_ep_headless(args, log_dir) -> dict:
    """DP=2 + EP: a head (API server + engine 0) and a `--headless` node (engine 1)."""
    rpc, port = str(server.free_port()), server.free_port()
    common = ("--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", rpc)
    head = _cmd(args, port, dp=2, ep=True, extra_args=common + ("--api-server-count", "1"))
    node = _cmd(args, server.free_port(), dp=2, ep=True,
                extra_args=common + ("--headless", "--data-parallel-start-rank", "1"))
    return _serve(args, log_dir, [("head", head, _env(args, omp_bind="0")),
                                  ("headless", node, _env(args, omp_bind="1"))],
                  [f"http://127.0.0.1:{port}"])


def api_servers_2(args, log_dir) -> dict:
    """One engine behind two API server processes (`--api-server-count 2`)."""
    port = server.free_port()
    cmd = _cmd(args, port, extra_args=("--api-server-count", "2"))
    return _serve(args, log_dir, [("server", cmd, _env(args))], [f"http://127.0.0.1:{port}"])


# VLLM_PLUGINS for a process that has the plugin installed but does not load it (a node whose
# image lacks it, as far as vLLM can tell): the test seam's plugins only.
WITHOUT_PLUGIN = {"VLLM_PLUGINS": "fp4_moe_cpu_sim,fp4_moe_blackwell_seam"}


def mp_pp(args, log_dir, stages: int, partition: str | None = None, switch: str = "1",
          loaded: bool = True) -> dict:
    """Pipeline parallel on the multiprocessing executor, one ``vllm serve``: ``partition``
    is VLLM_PP_LAYER_PARTITION ("1,2": a first stage of dense layers only, as operators give
    DeepSeek's); ``switch`` "1", "0" or "unset"; ``loaded`` False: the plugin is not loaded
    (stock vLLM, the reference for the switch unset)."""
    port = server.free_port()
    extra = {} if loaded else dict(WITHOUT_PLUGIN)
    if partition:
        extra["VLLM_PP_LAYER_PARTITION"] = partition
    env = _env(args, plugin=switch, omp_bind="|".join(str(i % 2) for i in range(stages)),
               **extra)
    cmd = _cmd(args, port, extra_args=("--pipeline-parallel-size", str(stages),
                                       "--distributed-executor-backend", "mp"))
    return _serve(args, log_dir, [("server", cmd, env)], [f"http://127.0.0.1:{port}"])


def ext_tp2(args, log_dir, rank1_switch: str = "1", rank0_switch: str = "1",
            loaded: tuple = (True, True), debug: bool = False) -> dict:
    """TP=2 with vLLM's external launcher: one offline ``LLM`` process per rank, each with its
    own environment, as torchrun starts them; ``rank1_switch`` "unset": rank 1 lacks the
    switch (a mixed fleet in a TP layout, where no scale agreement would ever notice);
    ``loaded``: per rank, whether vLLM loads the plugin there; ``debug``: vLLM logs at DEBUG
    (the fleet check's line for a fleet that is off)."""
    runner = Path(__file__).with_name("engine_run.py")
    port = str(server.free_port())
    specs = []
    for rank, switch in ((0, rank0_switch), (1, rank1_switch)):
        cmd = [str(args.python), str(runner), "--checkpoint", args.model, "--plugin", switch,
               "--executor", "external_launcher", "--tp", "2", "--kernel", args.kernel,
               "--prompts", json.dumps(PROMPTS), "--max-tokens", str(args.max_tokens)]
        if WORLD_ARGS[args.world]:
            cmd += ["--moe-backend", WORLD_ARGS[args.world][1]]
        env = _env(args, plugin=switch, omp_bind="0|1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   **({} if loaded[rank] else WITHOUT_PLUGIN),
                   **({"VLLM_LOGGING_LEVEL": "DEBUG"} if debug else {}))
        specs.append((f"rank{rank}", cmd, env))
    result = _serve(args, log_dir, specs, [], expect_refusal=True)  # offline: runs to the end
    for line in result["log"].splitlines():
        if line.startswith("RESULT "):
            result["tokens"].setdefault("offline", []).append(
                [p["tokens"] for p in json.loads(line[len("RESULT "):])])
    return result


SCENARIOS = {
    "single": lambda a, d: single(a, d),
    "mp-tp2": lambda a, d: single(a, d, tp=2),
    "mp-dp2-ep": lambda a, d: single(a, d, dp=2, ep=True),
    "compiled": lambda a, d: single(a, d, eager=False),
    "eager-moe-op": lambda a, d: single(a, d, extra_env={"FP4_MOE_TEST_MOE_OP": "1"}),
    "ray-tp2": lambda a, d: ray_tp2(a, d),
    "ray-tp2-node-off": lambda a, d: ray_tp2(a, d, node_switch="0"),
    "ray-dp2-ep": ray_dp2_ep,
    "dp2-ep-per-rank": lambda a, d: dp2_ep_per_rank(a, d),
    "dp2-ep-per-rank-rank1-unset": lambda a, d: dp2_ep_per_rank(a, d, rank1_switch="unset"),
    "dp2-ep-headless": dp2_ep_headless,
    "api-servers-2": api_servers_2,
    "ext-tp2": lambda a, d: ext_tp2(a, d),
    "ext-tp2-rank1-unset": lambda a, d: ext_tp2(a, d, rank1_switch="unset"),
    # rank 1 does not load the plugin: off everywhere serves; on where it loads refuses
    "ext-tp2-rank1-without-plugin-unset": lambda a, d: ext_tp2(
        a, d, "unset", "unset", loaded=(True, False), debug=True),
    "ext-tp2-rank1-without-plugin": lambda a, d: ext_tp2(a, d, "1", loaded=(True, False)),
    "ext-tp2-without-plugin": lambda a, d: ext_tp2(a, d, "unset", "unset",
                                                   loaded=(False, False)),
    "mp-pp1": lambda a, d: mp_pp(a, d, 1),  # the one-worker reference of the PP runs
    "mp-pp3": lambda a, d: mp_pp(a, d, 3),
    "mp-pp3-unset": lambda a, d: mp_pp(a, d, 3, switch="unset"),
    "mp-pp3-without-plugin": lambda a, d: mp_pp(a, d, 3, switch="unset", loaded=False),
    "mp-pp2-dense-stage": lambda a, d: mp_pp(a, d, 2, "1,2"),
    "mp-pp2-dense-stage-unset": lambda a, d: mp_pp(a, d, 2, "1,2", switch="unset"),
    "mp-pp2-dense-stage-without-plugin": lambda a, d: mp_pp(a, d, 2, "1,2", switch="unset",
                                                            loaded=False),
}


# -- what the log says ------------------------------------------------------------------

_PID = re.compile(r"\(([\w.-]*) ?pid=(\d+)\)")


def process_lines(log: str, needle: str) -> dict[str, str]:
    """{pid: process label} of every process that logged a line containing ``needle``; the
    label is vLLM's innermost named prefix (``Worker_TP0``, ``EngineCore_DP1``, ``APIServer``),
    the pid the record's own (``LOGGING_CONFIG`` puts it on every line of 0.11.0)."""
    out = {}
    for line in log.splitlines():
        if needle in line:
            found = _PID.findall(line)
            if found:
                pid = found[-1][1]
                names = [n for n, p in found if n and p == pid]
                out[pid] = names[-1] if names else out.get(pid, "")
    return out


def logs_of(result: dict) -> dict[str, str]:
    """The combined log split back into each launched process's own log."""
    out, name = {}, None
    for line in result["log"].splitlines():
        if line.startswith("===== "):
            name = line[6:]
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


# -- entry points -----------------------------------------------------------------------

def run(scenario: str, *, world: str, model: str, kernel: str = "emulator",
        timeout_s: float = 480, log_dir: Path | None = None, text_prompts=None,
        max_tokens: int = MAX_TOKENS) -> dict:
    """Run one scenario in a fresh network namespace (``unshare --net``); its result dict."""
    python = server.world_python(world)
    if python is None:
        raise FileNotFoundError(f"{server.REPO_ROOT / server.WORLDS[world]} is missing: run "
                                f"./scripts/bootstrap-engine.sh {world}")
    server.plugin_wheel.check(server.REPO_ROOT / server.WORLDS[world], world)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"deploy-{scenario}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out = log_dir / "result.json"
    cmd = ["unshare", "--net", sys.executable, "-m", __spec__.name, scenario,
           "--world", world, "--python", str(python), "--model", str(Path(model).resolve()),
           "--kernel", kernel, "--timeout", str(timeout_s), "--log-dir", str(log_dir),
           "--out", str(out), "--max-tokens", str(max_tokens)]
    if text_prompts:
        cmd += ["--text-prompts", json.dumps(text_prompts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s * 2 + 300)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"deployment driver failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--world", choices=sorted(WORLD_ENV), default="0.32.0")
    ap.add_argument("--python", required=True, help="the engine world's python")
    ap.add_argument("--model", required=True)
    ap.add_argument("--kernel", default="emulator")
    ap.add_argument("--text-prompts", default=None, help="JSON list of text prompts (a model "
                    "with its tokenizer) instead of the token-id PROMPTS")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--timeout", type=float, default=480)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [ln.split(":")[1].strip() for ln in links.splitlines()]
    if names != ["lo"]:  # the guarantee that nothing binds beyond loopback
        raise SystemExit(f"not in a loopback-only network namespace: {names}")
    t0 = time.monotonic()
    result = SCENARIOS[args.scenario](args, Path(args.log_dir))
    result.update(scenario=args.scenario, seconds=round(time.monotonic() - t0, 1),
                  interfaces=names)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
