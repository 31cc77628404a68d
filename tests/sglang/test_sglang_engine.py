"""weightwire inside SGLang, end to end, on SGLang 0.5.23's real model classes built on CPU.

The engine side runs as it would in SGLang's TP workers: SGLang's own `load_plugins()`
finds weightwire's entry point (`sglang.srt.plugins: weightwire`), which registers an AFTER
hook on `ModelRunner.load_model`; SGLang's own `HookRegistry.apply_hooks()` wraps the
method; each worker's `runner.load_model()` loads its model and the hook registers the
model's parameters with a real weightwired (LocalCluster, CURVE keys). SGLang's real
`ModelRunner` module cannot be imported here (it needs the server's packages: uvicorn,
...), so the module the hook targets is a stand-in whose `ModelRunner.load_model` does
what the real one does for the weights, with the CPU helpers: build the model class as
this rank (topology published as the scheduler publishes it) and load the checkpoint
through the model's own `load_weights`. Around every version each worker runs SGLang's real
`WeightUpdater.begin_weight_update` / `end_weight_update(run_post_load=True)` (what
`/begin_weight_update` and `/end_weight_update` run in a worker: post_load_weights rebuilds
MLA's w_kc/w_vc, post-processing runs, weightwire's check runs after).

Trainers publish real HF-named weights: FSDP-2 shards (rules mode), or full tensors through
SGLang CPU replicas (`SGLangReplica`, replica mode). After each version, every registered
parameter of every worker's model, and the derived tensors, must equal bit for bit what
SGLang's own `load_weights` makes from the same weights on a freshly built model of that
rank. All "workers" live in this one process, so each one's topology is published again
before SGLang code runs for it (in a server each worker is its own process).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not importable here: `make test-sglang` runs tests/sglang in .venv-sglang",
        allow_module_level=True,
    )

from . import sglang_cpu  # first: SGLANG_USE_CPU_ENGINE and the stand-in modules

# isort: split
import sglang.srt.plugins as sglang_plugins
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_runner_components.weight_updater import (
    WeightUpdater,
)
from sglang.srt.plugins.hook_registry import HookRegistry

from weightwire.adapters.sglang import plugin
from weightwire.adapters.sglang.layout import (
    layout_key,
    layouts_of,
    registered_parameters,
    source_name,
)
from weightwire.adapters.sglang.lifecycle import SGLangClient, update_weights
from weightwire.adapters.sglang.replica import SGLangReplica
from weightwire.client import Shard, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import hf_tensors
from weightwire.protocol.errors import RegistrationError

from ..hfweights import random_weights
from ..rulesref import BASE, CONFIGS
from ..test_sglang_lifecycle import RecordingSGLang

pytestmark = pytest.mark.filterwarnings("ignore")  # SGLang's import-time chatter

# A model the model-family rules do not know (shared expert with its own gate, qkv bias):
# replica mode needs nothing but SGLang's own class for it.
QWEN2_MOE: dict[str, Any] = {
    **{k: v for k, v in BASE.items() if k != "head_dim"},
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
}
MODELS = {**CONFIGS, "qwen2-moe": QWEN2_MOE}


def checkpoint_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """HF checkpoint names: the rules' list where they know the family, else by hand."""
    if cfg["model_type"] != "qwen2_moe":
        return [(t.name, t.shape, t.dtype) for t in hf_tensors(cfg)]
    H, V, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, mi, si = H // nh, cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            out += [(f"{p}.self_attn.{proj}_proj.weight", (rows, H))]
            out += [(f"{p}.self_attn.{proj}_proj.bias", (rows,))]
        out += [(f"{p}.self_attn.o_proj.weight", (H, nh * hd)), (f"{p}.mlp.gate.weight", (E, H))]
        for prefix, inter in [(f"{p}.mlp.experts.{e}", mi) for e in range(E)] + [
            (f"{p}.mlp.shared_expert", si)
        ]:
            out += [
                (f"{prefix}.gate_proj.weight", (inter, H)),
                (f"{prefix}.up_proj.weight", (inter, H)),
                (f"{prefix}.down_proj.weight", (H, inter)),
            ]
        out += [(f"{p}.mlp.shared_expert_gate.weight", (1, H))]
        out += [
            (f"{p}.input_layernorm.weight", (H,)),
            (f"{p}.post_attention_layernorm.weight", (H,)),
        ]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return [(n, s, "bfloat16") for n, s in out]


# --------------------------------------------------------------------------- SGLang worker
class ModelRunner:
    """Stands in for sglang.srt.model_executor.model_runner.ModelRunner where weightwire's
    hook reads it: `model`, `model_config` (model_path, hf_config), `device`, `gpu_id`,
    `is_draft_worker` (model_runner.py: __init__, load_model lines 1270-1321)."""

    def __init__(
        self, cfg: dict[str, Any], model_dir: Path, tp: int, rank: int, ep: int, ckpt: Any
    ) -> None:
        self.tp, self.rank, self.ep, self.cfg, self.checkpoint = tp, rank, ep, cfg, ckpt
        self.model_config = ModelConfig(model_path=str(model_dir), dtype="bfloat16")
        self.device, self.gpu_id, self.is_draft_worker = "cpu", rank, False
        self.model: torch.nn.Module | None = None

    def load_model(self) -> None:
        # The weights part of the real load_model, on CPU: the model class built as this
        # rank (its topology published, as the scheduler process has it), the checkpoint
        # loaded through the model's own load_weights.
        self.model = sglang_cpu.build_model(self.cfg, self.tp, self.rank, self.ep)
        sglang_cpu.load_hf_weights(self.model, self.checkpoint.items())

    def weight_updater(self) -> WeightUpdater:
        """SGLang's real WeightUpdater of this runner (begin/end_weight_update)."""
        return WeightUpdater(
            tp_rank=self.rank,
            device="cpu",
            gpu_id=self.gpu_id,
            model_config=self.model_config,
            custom_weight_loaders={},
            get_model=lambda: self.model,
            update_model_fields=lambda **kw: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: self,
        )


@pytest.fixture
def sglang_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[ModelRunner]]:
    """SGLang's plugin loading, for real, against the stand-in ModelRunner module."""
    if not any(ep.name == "weightwire" for ep in entry_points(group="sglang.srt.plugins")):
        pytest.fail(
            "weightwire's sglang.srt.plugins entry point is not installed in this venv: "
            "`.venv-sglang/bin/pip install --no-deps -e .` (scripts/sglang-env.sh installs "
            "weightwire only when the venv is made)"
        )
    module = types.ModuleType("sglang.srt.model_executor.model_runner")

    class Runner(ModelRunner):  # a fresh class: apply_hooks patches it in place
        pass

    module.ModelRunner = Runner  # type: ignore[attr-defined]
    original_load = Runner.load_model
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(WeightUpdater, "end_weight_update", WeightUpdater.end_weight_update)
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "weightwire")
    monkeypatch.setenv("WEIGHTWIRE_SGLANG", "rules")
    HookRegistry.reset()
    sglang_plugins.load_plugins()  # entry point -> weightwire's register() -> apply_hooks()
    assert [h for _, h, _ in HookRegistry._hooks[plugin.LOAD_MODEL]] == [plugin.after_load_model]
    assert Runner.load_model is not original_load
    assert Runner.load_model.__wrapped__ is original_load  # type: ignore[attr-defined]
    assert WeightUpdater.end_weight_update.__wrapped__  # type: ignore[attr-defined]
    yield Runner
    HookRegistry.reset()
    for model_id in list(plugin._BINDINGS):
        plugin._BINDINGS.pop(model_id).engine.close()


def start_workers(
    runner_cls: type[ModelRunner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cluster: LocalCluster,
    *,
    cfg: dict[str, Any],
    tp: int,
    ep: int,
    mode: str,
    replicas: int,
    job: str,
) -> list[ModelRunner]:
    """One SGLang server per engine replica, `tp` workers each: replica 0 on host 1, replica
    1 on host 0 (beside the trainers). Returns every worker's runner, engine rank order."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    initial = random_weights(checkpoint_shapes(cfg), 0)
    monkeypatch.setenv("WEIGHTWIRE_SGLANG", mode)
    monkeypatch.setenv("WEIGHTWIRE_JOB", job)
    monkeypatch.setenv("WEIGHTWIRE_ENGINE_REPLICAS", str(replicas))
    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_S", "60")
    runners = []
    for replica in range(replicas):
        monkeypatch.setenv("WEIGHTWIRE_SOCKET", cluster.daemons[1 - replica % 2].socket)
        monkeypatch.setenv("WEIGHTWIRE_ENGINE_REPLICA", str(replica))
        for rank in range(tp):
            runner = runner_cls(cfg, model_dir, tp, rank, ep, initial)
            runner.load_model()  # the hooked method, as ModelRunner.initialize() calls it
            binding = plugin.binding_of(runner.model)
            assert binding is not None and binding is runner.weightwire  # type: ignore[attr-defined]
            assert (binding.rank, binding.world_size) == (replica * tp + rank, replicas * tp)
            assert binding.key == layout_key(tp, rank, ep)
            runners.append(runner)
    return runners


def reference(cfg: dict[str, Any], tp: int, rank: int, ep: int, hf: Any) -> torch.nn.Module:
    model = sglang_cpu.build_model(cfg, tp, rank, ep)
    sglang_cpu.load_hf_weights(model, hf.items())
    return model


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_bitwise(runners: list[ModelRunner], hf: Any, version: int) -> None:
    refs: dict[int, torch.nn.Module] = {}
    for runner in runners:
        if runner.rank not in refs:
            refs[runner.rank] = reference(runner.cfg, runner.tp, runner.rank, runner.ep, hf)
        ref = refs[runner.rank]
        assert runner.model is not None
        binding = plugin.binding_of(runner.model)
        assert binding is not None
        got = dict(runner.model.named_parameters())  # what the model computes with
        want = registered_parameters(ref)
        assert set(binding.registered) == set(want)
        bad = [n for n, t in want.items() if not torch.equal(raw(got[n]), raw(t))]
        # Derived tensors (MLA w_kc/w_vc): rebuilt by end_weight_update's post_load_weights.
        got_attrs = dict(sglang_cpu.extra_tensor_attrs(runner.model))
        want_attrs = dict(sglang_cpu.extra_tensor_attrs(ref))
        assert set(got_attrs) == set(want_attrs)
        bad += [n for n, t in want_attrs.items() if not torch.equal(raw(got_attrs[n]), raw(t))]
        assert not bad, f"v{version} engine rank {binding.rank}: differ from SGLang: {bad}"


def sync(runners: list[ModelRunner], version: int, publish: Callable[[], None]) -> None:
    """One weight update as an SGLang server does it around weightwire's writes."""
    updaters = [r.weight_updater() for r in runners]
    for runner, upd in zip(runners, updaters, strict=True):
        assert runner.model is not None
        sglang_cpu.republish(runner.model)
        upd.begin_weight_update()
    publish()
    for runner, upd in zip(runners, updaters, strict=True):
        assert runner.model is not None
        binding = plugin.binding_of(runner.model)
        assert binding is not None
        binding.engine.wait(version)
        sglang_cpu.republish(runner.model)
        upd.end_weight_update(run_post_load=True)  # + weightwire's AFTER check


def in_threads(fns: list[Callable[[], Any]]) -> None:
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


# --------------------------------------------------------------------------- rules mode
@pytest.mark.parametrize(
    ("name", "tp", "ep"),
    [("qwen3", 2, 1), ("qwen3-moe", 2, 2), ("deepseek-v3", 2, 1)],
)
def test_rules_mode_workers(
    sglang_hooks: type[ModelRunner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cluster: LocalCluster,
    name: str,
    tp: int,
    ep: int,
) -> None:
    """FSDP-2 trainers -> TP workers registered by the plugin, recipes by the rules."""
    cfg = MODELS[name]
    job = f"sglang-rules-{name}-{tp}-{ep}"
    runners = start_workers(
        sglang_hooks, monkeypatch, tmp_path, cluster,
        cfg=cfg, tp=tp, ep=ep, mode="rules", replicas=1, job=job,
    )  # fmt: skip
    trainers: list[tuple[Trainer, dict[str, torch.Tensor]]] = []
    for version in (1, 2):
        hf = random_weights(checkpoint_shapes(cfg), version)
        if not trainers:
            for r in range(2):
                tr = Trainer(r, 2, socket=cluster.daemons[0].socket, job=job, timeout_s=60)
                mine = {n: t.chunk(2)[r].clone() for n, t in hf.items()}
                tr.register(
                    mine,
                    layout=Shard(0, r, 2),
                    global_shapes={n: tuple(t.shape) for n, t in hf.items()},
                )
                trainers.append((tr, mine))
        for r, (_, mine) in enumerate(trainers):
            for n, t in hf.items():
                mine[n].copy_(t.chunk(2)[r])
        sync(
            runners,
            version,
            lambda v=version: in_threads(
                [lambda tr=tr: tr.publish(v) for tr, _ in trainers]  # type: ignore[misc]
            ),
        )
        check_bitwise(runners, hf, version)
    # Post-processing that moves a registered parameter is caught at end_weight_update.
    victim = runners[0]
    assert victim.model is not None
    param = dict(victim.model.named_parameters())["model.norm.weight"]
    param.data = param.data.clone()
    sglang_cpu.republish(victim.model)
    with pytest.raises(RuntimeError, match=r"replaced the storage .* model\.norm\.weight"):
        victim.weight_updater().end_weight_update(run_post_load=False)
    for tr, _ in trainers:
        tr.close()


# --------------------------------------------------------------------------- replica mode
@pytest.mark.parametrize(
    ("name", "tp", "ep", "replicas", "trainers"),
    [
        ("qwen3-moe", 2, 1, 2, 2),  # 2 engine replicas read one CPU replica per layout
        ("qwen3-moe", 2, 2, 2, 1),  # one trainer rank holds both layouts' replicas
        ("qwen2-moe", 2, 1, 2, 2),  # a model the rules do not know
        ("deepseek-v3", 2, 2, 1, 2),  # MLA: w_kc/w_vc rebuilt by end_weight_update
    ],
)
def test_replica_mode_workers(
    sglang_hooks: type[ModelRunner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cluster: LocalCluster,
    name: str,
    tp: int,
    ep: int,
    replicas: int,
    trainers: int,
) -> None:
    """Trainer-side SGLang CPU replicas (zero-copy sources) -> TP workers of `replicas`
    engine replicas, one to one by name."""
    cfg = MODELS[name]
    job = f"sglang-replica-{name}-{tp}-{ep}-{replicas}-{trainers}"
    runners = start_workers(
        sglang_hooks, monkeypatch, tmp_path, cluster,
        cfg=cfg, tp=tp, ep=ep, mode="replica", replicas=replicas, job=job,
    )  # fmt: skip
    reps: list[SGLangReplica] = []
    for r in range(trainers):
        tr = Trainer(r, trainers, socket=cluster.daemons[0].socket, job=job, timeout_s=60)
        rep = SGLangReplica(tr, cfg, tp_size=tp, ep_size=ep)
        assert [lay.tp_rank for lay in rep.layouts] == layouts_of(r, trainers, tp)
        reps.append(rep)
    for rep in reps:
        plan = rep.trainer.prepare()
        # Zero-copy: every write from the replica memory itself; each layout feeds the
        # same TP rank of every engine replica.
        assert plan.staging_bytes == 0
        writes = [w for b in plan.buckets for w in b.writes]
        assert writes and all(w.src_region >= 0 for w in writes)
        want_ranks = {e * tp + lay.tp_rank for lay in rep.layouts for e in range(replicas)}
        assert {w.dst_rank for w in writes} == want_ranks
    for version in (1, 2):
        hf = random_weights(checkpoint_shapes(cfg), version)
        sync(
            runners,
            version,
            lambda v=version, hf=hf: in_threads(
                [lambda rep=rep: rep.publish(v, hf) for rep in reps]  # type: ignore[misc]
            ),
        )
        check_bitwise(runners, hf, version)
        # The replica itself holds what SGLang's load_weights makes for its layout.
        for rep in reps:
            for lay in rep.layouts:
                ref = registered_parameters(reference(cfg, tp, lay.tp_rank, ep, hf))
                for n, t in ref.items():
                    assert torch.equal(raw(lay.sources[source_name(lay.key, n)]), raw(t)), n
    for rep in reps:
        rep.close()
        rep.trainer.close()


def test_replica_refuses_weights_it_never_got(cluster: LocalCluster) -> None:
    """SGLang's loaders skip what they cannot place with a log line; the replica's first
    publish names every parameter load_weights left unwritten instead of sending it."""
    cfg = MODELS["qwen3"]
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job="sglang-replica-missing")
    rep = SGLangReplica(tr, cfg, tp_size=2, tp_ranks=[1])
    hf = random_weights(checkpoint_shapes(cfg), 3)
    del hf["model.layers.1.mlp.down_proj.weight"], hf["model.norm.weight"]
    with pytest.raises(RegistrationError, match=r"never .* written") as err:
        rep.publish(1, hf)
    assert "tp1of2/model.layers.1.mlp.down_proj.weight" in str(err.value)
    assert "tp1of2/model.norm.weight" in str(err.value)
    assert "layers.0" not in str(err.value)
    rep.close()
    tr.close()


def test_settings_from_env() -> None:
    s = plugin.Settings.from_env({})
    assert s.mode == "off"
    s = plugin.Settings.from_env(
        {
            "WEIGHTWIRE_SGLANG": "Replica",
            "WEIGHTWIRE_SOCKET": "/tmp/x.sock",
            "WEIGHTWIRE_JOB": "rl",
            "WEIGHTWIRE_ENGINE_REPLICA": "3",
            "WEIGHTWIRE_ENGINE_REPLICAS": "4",
        }
    )
    assert (s.mode, s.socket, s.job, s.replica, s.replicas) == (
        "replica",
        "/tmp/x.sock",
        "rl",
        3,
        4,
    )
    with pytest.raises(ValueError, match="WEIGHTWIRE_SGLANG='fast'"):
        plugin.Settings.from_env({"WEIGHTWIRE_SGLANG": "fast"})
    with pytest.raises(ValueError, match="WEIGHTWIRE_ENGINE_REPLICAS='two'"):
        plugin.Settings.from_env(
            {"WEIGHTWIRE_SGLANG": "rules", "WEIGHTWIRE_ENGINE_REPLICAS": "two"}
        )


def test_plugin_is_inert_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed weightwire changes no SGLang server that does not set WEIGHTWIRE_SGLANG."""
    monkeypatch.delenv("WEIGHTWIRE_SGLANG", raising=False)
    HookRegistry.reset()
    plugin.register()
    assert not HookRegistry._hooks.get(plugin.LOAD_MODEL)
    HookRegistry.reset()


# --------------------------------------------------------------------------- an RL loop
def test_rl_loop_with_the_lifecycle_client(
    sglang_hooks: type[ModelRunner],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cluster: LocalCluster,
) -> None:
    """The README's loop: two trainer ranks with CPU replicas publish each step inside
    `update_weights` on two SGLang servers (recording stand-ins whose /begin_weight_update
    and /end_weight_update run SGLang's real WeightUpdater in that server's workers); the
    other rank waits at a barrier (torch.distributed's, in a real trainer) for the engines'
    sessions to open, and the driver's transfer ends when every rank's publish returned."""
    cfg, tp, job = MODELS["qwen3"], 2, "sglang-rl-loop"
    runners = start_workers(
        sglang_hooks, monkeypatch, tmp_path, cluster,
        cfg=cfg, tp=tp, ep=1, mode="replica", replicas=2, job=job,
    )  # fmt: skip

    def session(workers: list[ModelRunner], end: bool) -> Callable[[], None]:
        def run() -> None:
            for w in workers:
                assert w.model is not None
                sglang_cpu.republish(w.model)
                upd = w.weight_updater()
                upd.end_weight_update(run_post_load=True) if end else upd.begin_weight_update()

        return run

    async def main() -> None:
        servers = []
        for e in range(2):
            workers = runners[e * tp : (e + 1) * tp]
            actions = {
                "/begin_weight_update": session(workers, end=False),
                "/end_weight_update": session(workers, end=True),
            }
            servers.append(await RecordingSGLang(f"engine{e}", actions=actions).start())
        trainers = [Trainer(r, 2, socket=cluster.daemons[0].socket, job=job) for r in range(2)]
        replicas = [SGLangReplica(tr, cfg, tp_size=tp) for tr in trainers]
        for tr in trainers:
            tr.prepare()
        in_session, landed = threading.Barrier(2), threading.Barrier(2)
        engines = [SGLangClient(s.url) for s in servers]
        for step in (1, 2):
            # the RL framework's gathered HF state dict
            hf = random_weights(checkpoint_shapes(cfg), step)

            def rank_publishes(rank: int, step: int = step, hf: Any = hf) -> None:
                in_session.wait(30)  # dist.barrier(): the engines' sessions are open
                replicas[rank].publish(step, hf)
                landed.wait(30)  # dist.barrier(): every rank's writes landed

            other = threading.Thread(target=rank_publishes, args=(1,))
            other.start()
            report = await update_weights(
                engines, step, lambda f=rank_publishes: asyncio.to_thread(f, 0)
            )
            other.join(30)
            assert report.version == str(step)
            for w in runners:
                assert w.model is not None
                binding = plugin.binding_of(w.model)
                assert binding is not None and binding.engine.latest.version == step
            check_bitwise(runners, hf, step)
            for s in servers:
                assert [c.path for c in s.calls[-6:]] == [
                    "/pause_generation",
                    "/flush_cache",
                    "/begin_weight_update",
                    "/end_weight_update",
                    "/update_weight_version",
                    "/continue_generation",
                ]
                assert s.weight_version == str(step) and not s.paused
        for rep in replicas:
            rep.close()
            rep.trainer.close()
        for s in servers:
            await s.stop()

    asyncio.run(main())
