# SPDX-License-Identifier: Apache-2.0
"""The release sweep: every vLLM release from 0.11.0 on, each in a throwaway world, measured.

For each release: a fresh virtualenv (``.sweep/vllm-X``) with ``pip install vllm==X`` and its own
requirements (``constraints/vllm-X.txt`` pins where they do not resolve), this plugin and the lab
``--no-deps`` from a snapshot of the commit (``.sweep/src-<commit>``, ``git archive HEAD``: the
checkout may be edited while a sweep runs for hours, and each row names the commit it measured);
the probe (design, patchable, the patches it plans, the upstream fixes it sees);
FlashInfer uninstalled on the oracle design (the seam stands in for it only where it is absent);
the layer matrix (``matrix --json``: both formats, every layout and backend the release has) and
the uncalibrated rows (``matrix --uncalibrated --json``); one row in
``docs/data/releases.json``; the world deleted. Resumable: a release already in the table is
skipped unless ``--force``. Disk is checked before each world. Standard library only: it drives
the worlds, it runs in none.

Usage: ``python -m fp4_moe_lab.sweep [--release X ...] [--force] [--keep] [--table PATH]``
(``scripts/sweep.sh`` runs it with the lab on the path). A world kept by ``--keep`` holds the
snapshot's plugin and lab: before running the checkout's tests in it (``tests/nvfp4_oracle``),
install the checkout's over them (``.sweep/vllm-X/bin/python -m pip install --no-deps -e . -e
./lab``), or pytest mixes the checkout's plugin (on the path from the repository root) with the
snapshot's lab.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from fp4_moe_lab.checkout import ROOT

FIRST = (0, 11, 0)
TABLE = ROOT / "docs" / "data" / "releases.json"
WORLDS = ROOT / ".sweep"
NEED_GIB = 16  # a world: ~10 GiB installed, pip's temporary files besides
# A release pinning a torch the index has as +cpu (0.28.0: 2.13.0) gets these from PyPI built for
# CUDA torch: they fail at import ("torchvision::nms does not exist", torchcodec's and
# torchaudio's libraries), and transformers and vLLM's multimodal code import them when present
# (an OSError vLLM does not catch). Its MoE code needs none: one that cannot import is removed.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# what a row measures: its key -> the ``matrix`` arguments (the layer matrix; one expert's
# activation scale uncalibrated; gate and up with their own weight global scales, as published
# GLM exports write them, up to 10x)
STEPS = {"matrix": (), "uncalibrated": ("--uncalibrated",),
         "gate_up_split": ("--gate-up-split", "1.1", "--gate-up-split", "4",
                           "--gate-up-split", "10")}
CHAIN = "vllm-chain"  # --chain's one world
PROBE = """
import json
from vllm_fp4_moe_plugin.patches import compat, ledger
import vllm
obs = compat.probe()
plan = ledger.plan(obs)
print(json.dumps({"vllm": vllm.__version__, "design": obs.design, "patchable": obs.patchable,
                  "reason": plan.reason, "install": plan.install,
                  "upstream_fixed": plan.upstream_fixed, "patches": list(plan.patches),
                  "findings": {k: v if isinstance(v, (bool, str, type(None))) else repr(v)
                               for k, v in obs.findings.items()}}))
"""


def releases(first: tuple = FIRST) -> list[str]:
    """The final releases of vLLM on the package index from ``first`` on, oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"],
                         capture_output=True, text=True, timeout=300).stdout
    found = re.search(r"Available versions: (.*)", out)
    if not found:
        raise SystemExit("pip index versions vllm gave no list: is the package index reachable?")
    versions = [v.strip() for v in found.group(1).split(",")]
    final = [v for v in versions if re.fullmatch(r"\d+\.\d+\.\d+", v)]
    return sorted((v for v in final if tuple(map(int, v.split("."))) >= first),
                  key=lambda v: tuple(map(int, v.split("."))))


def free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / 2 ** 30


def snapshot() -> tuple[Path, str]:
    """HEAD's tree exported once under ``.sweep/`` (what every world installs and runs in) and
    its commit. Uncommitted edits are not measured: said, not refused."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    commit = git("rev-parse", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        print(f"[sweep] uncommitted changes are not measured: the worlds run {commit[:12]}",
              file=sys.stderr)
    src = WORLDS / f"src-{commit[:12]}"
    if not src.exists():
        WORLDS.mkdir(exist_ok=True)
        # a part of its own: sweeps started together on one commit race to export it
        tmp = Path(tempfile.mkdtemp(prefix=f".src-{commit[:12]}.", suffix=".part", dir=WORLDS))
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        try:
            tmp.rename(src)
        except OSError:  # another sweep got there first: the same tree
            if not src.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return src, commit


def _run(cmd: list, log, timeout: float, cwd: Path = ROOT, **kw) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout,
                       cwd=cwd, **kw)
    log.write(r.stdout[-20000:] + r.stderr[-20000:] + f"[exit {r.returncode}]\n")
    log.flush()
    return r


def _install(release: str, venv: Path, src: Path, log) -> Optional[str]:
    """Build the world (vLLM and its requirements), or move a chained one to ``release`` (pip
    installs what differs); the error line when it cannot be built."""
    py = venv / "bin" / "python"
    if not py.exists():
        r = _run([sys.executable, "-m", "venv", venv], log, 300)
        if r.returncode:
            return "venv: " + r.stderr.strip()[-300:]
    for marker in (".pinned", ".without-flashinfer"):  # a chained world's last release's
        (venv / marker).unlink(missing_ok=True)
    pins = src / "constraints" / f"vllm-{release}.txt"
    # [flashinfer]: 0.11.x ships FlashInfer as an extra, which the 0.11.0-era seam runs with;
    # later releases require it (a missing extra only draws pip's warning)
    cmd = [py, "-m", "pip", "install", "-q", f"vllm[flashinfer]=={release}", "pytest",
           "safetensors"]
    if pins.exists():
        cmd[4:4] = ["-c", pins]
    # pip's own temporary directory, deleted with the world: without a cache pip leaves its
    # pip-unpack-* folders (up to ~1 GiB each) in the system one, which a sweep of hours fills
    tmp = _tmp(venv)
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1", "TMPDIR": str(tmp)}
    r = _run(cmd, log, 3600, env=env)
    if r.returncode and _pinned_by_name(pins):  # the focused world's recipe, as
        r = _install_pinned(release, py, pins, log, env)  # bootstrap-release.sh builds it
        if r.returncode == 0:
            (venv / ".pinned").write_text(release)
    elif r.returncode and re.search(r"No matching distribution found for flashinfer", r.stderr):
        r = _install_without_flashinfer(release, py, pins, log, env)
        if r.returncode == 0:
            (venv / ".without-flashinfer").write_text(release)
    if r.returncode:
        return "pip install vllm: " + (r.stderr.strip().splitlines() or ["?"])[-1][:300]
    for extra in CUDA_ONLY_EXTRAS:
        if _run([py, "-c", f"import {extra}"], log, 600).returncode:
            _run([py, "-m", "pip", "uninstall", "-y", "-q", extra], log, 600)
    return None


def _pinned_by_name(pins: Path) -> bool:
    """A constraints file naming ``vllm==`` can build the world by name where the release's own
    requirements do not resolve (0.34.0: flashinfer-python==0.7.3 is not on the index, and
    without it humming-kernels, tilelang, torchvision and transformers conflict)."""
    return pins.exists() and any(line.startswith("vllm==")
                                 for line in pins.read_text().splitlines())


def _install_pinned(release: str, py: Path, pins: Path, log,
                    env: dict) -> subprocess.CompletedProcess:
    """Every pinned name but vLLM, then vLLM ``--no-deps`` (as scripts/bootstrap-release.sh
    builds .venv-vllm-0.34.0)."""
    names = [line.strip() for line in pins.read_text().splitlines()
             if re.match(r"[A-Za-z]", line) and not line.startswith("vllm==")]
    r = _run([py, "-m", "pip", "install", "-q", "-c", pins, *names, "pytest"], log, 3600,
             env=env)
    if r.returncode:
        return r
    return _run([py, "-m", "pip", "install", "-q", "--no-deps", "-c", pins, f"vllm=={release}"],
                log, 3600, env=env)


def without_flashinfer(requires: list[str]) -> list[str]:
    """A package's ``Requires-Dist`` less FlashInfer's packages and the optional extras."""
    return [q for q in requires if not re.match(r"flashinfer[-_]", q, re.I)
            and not re.search(r"\bextra\s*==", q)]


def _install_without_flashinfer(release: str, py: Path, pins: Path, log,
                                env: dict) -> subprocess.CompletedProcess:
    """vLLM and its own requirements less FlashInfer, for a release pinning a FlashInfer the
    index does not carry (0.34.0: flashinfer-python==0.7.3). Its design runs without FlashInfer
    anyway: the oracle seam stands in for an absent one only."""
    c = ["-c", pins] if pins.exists() else []
    r = _run([py, "-m", "pip", "install", "-q", "--no-deps", *c, f"vllm=={release}"], log, 3600,
             env=env)
    if r.returncode:
        return r
    reqs = _run([py, "-c", "import importlib.metadata as m, json; "
                 "print(json.dumps(m.requires('vllm') or []))"], log, 300)
    keep = without_flashinfer(json.loads(reqs.stdout or "[]"))
    return _run([py, "-m", "pip", "install", "-q", *c, *keep, "pytest", "safetensors"], log,
                3600, env=env)


def _install_plugin(venv: Path, src: Path, log) -> Optional[str]:
    """This commit's plugin and lab into the world (also a kept one, built from another)."""
    r = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "-e", ".",
              "-e", "./lab"], log, 600, cwd=src)
    return None if r.returncode == 0 else "pip install plugin: " + r.stderr.strip()[-300:]


def _tmp(venv: Path) -> Path:
    return venv.with_name(venv.name + ".tmp")


def _json(r: subprocess.CompletedProcess):
    """The JSON document a command printed last (vLLM may log to stdout before it)."""
    lines = r.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    return None


def measure(release: str, src: Path, commit: str, keep: bool = False,
            steps: tuple = STEPS, chain: bool = False) -> dict:
    """One release's row, ``steps`` of it (every cell measured in its own world; a world kept by
    ``--keep`` is measured again as it is). ``chain``: one world for the releases in turn,
    ``pip install vllm==X`` over the last (its requirements resolved again, anything it no
    longer needs left behind), kept for the next."""
    venv, t0 = WORLDS / (CHAIN if chain else f"vllm-{release}"), time.monotonic()
    row: dict = {"release": release, "date": time.strftime("%Y-%m-%d"), "commit": commit[:12],
                 "error": None}
    WORLDS.mkdir(exist_ok=True)
    log_path = WORLDS / f"vllm-{release}.log"
    with open(log_path, "w") as log:
        try:
            built = (venv / ".built").read_text() if (venv / ".built").exists() else None
            if built != release and not (built and not chain):
                if not chain:
                    shutil.rmtree(venv, ignore_errors=True)
                elif built:
                    row["install"] = f"chained: vllm=={release} over the {built} world"
                row["error"] = _install(release, venv, src, log)
                (venv / ".built").unlink(missing_ok=True)
                if row["error"] is None:
                    (venv / ".built").write_text(release)
            row["error"] = row["error"] or _install_plugin(venv, src, log)
            if (venv / ".pinned").exists():
                row["install"] = f"constraints/vllm-{release}.txt by name, vLLM --no-deps"
            if (venv / ".without-flashinfer").exists():
                row["install"] = "vLLM's requirements less FlashInfer (its pin is not on the index)"
            row["install_s"] = round(time.monotonic() - t0)
            if row["error"] is None:
                _measure_in(venv / "bin" / "python", row, src, log, steps)
        except subprocess.TimeoutExpired as exc:
            row["error"] = f"timed out: {exc.cmd[:4]}"
        finally:
            shutil.rmtree(_tmp(venv), ignore_errors=True)
            if not keep and not chain:
                shutil.rmtree(venv, ignore_errors=True)
    row["seconds"] = round(time.monotonic() - t0)
    row["log"] = str(log_path.relative_to(ROOT))
    return row


def _measure_in(py: Path, row: dict, src: Path, log, steps: tuple = STEPS) -> None:
    probe = _json(_run([py, "-c", PROBE], log, 900, cwd=src))
    if probe is None:
        row["error"] = "the probe did not run (see the log)"
        return
    row.update(probe=probe, design=probe["design"], patches=probe["patches"])
    if probe["design"] == "nvfp4_oracle":  # the seam stands in for an absent FlashInfer only
        _run([py, "-m", "pip", "uninstall", "-y", "-q", "flashinfer-python", "flashinfer-cubin",
              "flashinfer-jit-cache"], log, 600)
    for step in steps:
        t = time.monotonic()
        # --debug: an internal error leaves its traceback (a rank's included) in the log
        r = _run([py, "-m", "fp4_moe_lab.cli", "--debug", "matrix", *STEPS[step], "--json"], log,
                 3600, cwd=src)
        row[f"{step}_s"] = round(time.monotonic() - t)
        row[step] = summary(_json(r) or [], r.returncode)


def summary(rows: list, exit_code: int) -> dict:
    """What a table row says of one run: rows, all ok, the holes stock has, the worst plugin
    error (relative, against the ideal NVFP4 layer) and the rows that are not ok. A hole is a row
    where stock gives an answer and it is wrong: a row stock cannot run (an error, or vLLM
    refusing the layout) is not counted as one."""
    finite = [r["plugin_rel_err"] for r in rows  # a layout vLLM refuses has no error to show
              if isinstance(r.get("plugin_rel_err"), float) and not r.get("vllm_refuses")]
    return {"exit": exit_code, "rows": len(rows), "ok": bool(rows) and all(r["ok"] for r in rows),
            "vllm_refuses": sum(bool(r.get("vllm_refuses")) for r in rows),
            "stock_holes": sorted({"/".join(str(r.get(k)) for k in
                                            ("format", "layout", "backend", "case") if r.get(k))
                                   for r in rows if r.get("stock_affected")
                                   and not r.get("stock_error") and not r.get("vllm_refuses")}),
            "worst_plugin_rel_err": max(finite) if finite else None,
            "not_ok": [{k: r.get(k) for k in ("format", "layout", "backend", "gemm", "case",
                                              "stock_rel_err", "plugin_rel_err")}
                       for r in rows if not r["ok"]]}


def render(table: dict) -> str:
    """docs/SUPPORT.md's release table: one row per measured release."""
    lines = ["| vLLM | design | patches planned | matrix rows ok | stock holes | worst plugin "
             "error | uncalibrated rows ok | gate/up split rows ok | measured | s |",
             "|---" * 10 + "|"]
    for release, row in table.items():
        m, u = row.get("matrix") or {}, row.get("uncalibrated") or {}
        g = row.get("gate_up_split") or {}

        def ok(part):
            n = part.get("vllm_refuses")
            refused = f", {n} refused by vLLM" if n else ""
            return (f"{'yes' if part.get('ok') else '**no**'} ({part.get('rows', 0)}{refused})"
                    if part else "-")
        worst = m.get("worst_plugin_rel_err")
        lines.append(" | ".join([
            f"| {release}", row.get("design") or "-", str(len(row.get("patches") or [])),
            ok(m), str(len(m.get("stock_holes", []))) if m else "-",
            f"{worst:.2g}" if isinstance(worst, float) else "-", ok(u), ok(g),
            row["date"] + (f": {row['error']}" if row.get("error") else ""),
            f"{row['seconds']} |"]))
    return "\n".join(lines)


def publish(table: dict, doc: Path = ROOT / "docs" / "SUPPORT.md") -> None:
    """Write :func:`render` between docs/SUPPORT.md's ``<!-- releases -->`` markers."""
    write_between(doc, "releases", render(table))


def write_between(doc: Path, mark: str, text: str) -> None:
    """Replace what lies between ``doc``'s ``<!-- mark -->`` and ``<!-- /mark -->`` lines."""
    head, found, rest = doc.read_text().partition(f"<!-- {mark} -->\n")
    if not found:
        raise SystemExit(f"{doc}: no <!-- {mark} --> marker to write the table under")
    _, _, tail = rest.partition(f"<!-- /{mark} -->")
    doc.write_text(f"{head}<!-- {mark} -->\n{text}\n<!-- /{mark} -->{tail}")


def by_release(table: dict) -> dict:
    """The table's rows, oldest release first."""
    return dict(sorted(table.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))


def load(table: Path) -> dict:
    return json.loads(table.read_text()) if table.exists() else {}


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", action="append", help="only this release (repeatable)")
    ap.add_argument("--force", action="store_true", help="measure releases already in the table")
    ap.add_argument("--keep", action="store_true", help="keep each world (disk!)")
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--only", action="append", choices=tuple(STEPS),
                    help="measure only this part of each row (repeatable), kept beside the "
                    "row's others; a release whose row has them is skipped (--force: not)")
    ap.add_argument("--chain", action="store_true",
                    help="one world moved from release to release (pip installs what differs: "
                    "minutes less each; the row says so), deleted at the end unless --keep")
    ap.add_argument("--report", action="store_true",
                    help="only write the table into docs/SUPPORT.md, measure nothing")
    args = ap.parse_args(argv)
    if args.report:
        publish(load(args.table))
        return 0
    todo = args.release or releases()
    table = load(args.table)
    src, commit = snapshot()
    steps = tuple(dict.fromkeys(args.only or STEPS))
    for release in todo:
        have = table.get(release, {})
        # measured: present and run (a part that ran no row, e.g. a broken world, is redone)
        if not args.force and have and all((have.get(step) or {}).get("rows")
                                           for step in steps):
            print(f"[sweep] {release}: in the table ({have['date']}), skipped")
            continue
        if free_gib(ROOT) < NEED_GIB:
            print(f"[sweep] stopping before {release}: {free_gib(ROOT):.1f} GiB free, "
                  f"a world needs {NEED_GIB}", file=sys.stderr)
            return 3
        print(f"[sweep] {release}: building and measuring ...", flush=True)
        started = time.monotonic()
        row = measure(release, src, commit, keep=args.keep, steps=steps, chain=args.chain)
        table = load(args.table)  # another sweep may have written meanwhile
        if args.only and release in table:  # the row's other parts stay as measured
            old = table[release]
            parts = {k: row[k] for k in row if k.startswith(steps)}
            row = {**old, **parts, "error": old.get("error") or row["error"],
                   f"{'+'.join(steps)}_measured": {k: row.get(k) for k in
                                                   ("date", "commit", "install", "error")}}
        table[release] = row
        ordered = by_release(table)
        args.table.write_text(json.dumps(ordered, indent=1) + "\n")
        publish(ordered)
        parts = ", ".join(f"{step} ok {(row.get(step) or {}).get('ok')} "
                          f"({(row.get(step) or {}).get('rows', 0)} rows, worst plugin "
                          f"{(row.get(step) or {}).get('worst_plugin_rel_err')})" for step in steps)
        print(f"[sweep] {release}: {row.get('design')} {row['error'] or ''} {parts}; "
              f"{round(time.monotonic() - started)} s", flush=True)
    if args.chain and not args.keep:
        shutil.rmtree(WORLDS / CHAIN, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
