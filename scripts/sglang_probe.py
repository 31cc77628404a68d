"""Probe SGLang's real model classes on CPU: build each TP/EP rank, load random
HF-named weights through the model's own ``load_weights``, print every engine
tensor (name, shape, dtype) per rank, and check every one bitwise against the
expected SGLang layout computed here by hand from the HF tensors.

Run inside the SGLang venv (scripts/sglang-env.sh makes it):

    .venv-sglang/bin/python scripts/sglang_probe.py            # required cases
    .venv-sglang/bin/python scripts/sglang_probe.py --all      # + Llama, Qwen2,
                                                               #   DeepSeek-V3, Kimi-K2, FP8
    .venv-sglang/bin/python scripts/sglang_probe.py --quiet    # no per-tensor listing
    .venv-sglang/bin/python scripts/sglang_probe.py --case qwen3-moe:2:2
    .venv-sglang/bin/python scripts/sglang_probe.py --case deepseek-v3:2:1:fused

Exit status 0 only if every case built, loaded and matched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import sglang_cpu  # noqa: E402  (sets SGLANG_USE_CPU_ENGINE, installs stand-ins)
import torch  # noqa: E402

# --------------------------------------------------------------------------- configs
_BASE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1000,  # not a multiple of 64: exercises vocab padding
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
_YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_DSV3 = dict(
    _BASE,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=2,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_scaling=_YARN,  # SGLang's CPU rope factory asserts rope_scaling for MLA
    num_nextn_predict_layers=0,
)
_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
CONFIGS: dict[str, dict] = {
    "qwen3": dict(_BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3-tied": dict(
        _BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True
    ),
    "qwen3-moe": dict(
        _BASE,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "llama": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(_BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", head_dim=16),
    "deepseek-v3": _DSV3,
    "kimi-k2": dict(_DSV3, model_type="kimi_k2", n_group=1, topk_group=1),
    # FP8 block-quantized (128x128): every per-rank shard must be block aligned.
    "qwen3-fp8": dict(
        _BASE,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        quantization_config=_FP8,
    ),
    "deepseek-v3-fp8": dict(
        _DSV3,
        hidden_size=256,
        intermediate_size=512,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        moe_intermediate_size=256,
        quantization_config=_FP8,
    ),
}

# name:tp:ep[:fused]  (fused = enforce_shared_experts_fusion, DeepSeek only)
REQUIRED = [
    "qwen3:1:1",
    "qwen3:2:1",
    "qwen3:4:1",
    "qwen3-moe:1:1",
    "qwen3-moe:2:1",
    "qwen3-moe:2:2",
    "qwen3-moe:4:2",
]
EXTRA = [
    "llama:2:1",
    "qwen2:4:1",
    "qwen3-moe:4:4",
    "qwen3-tied:2:1",
    "deepseek-v3:2:1",
    "deepseek-v3:2:2",
    "deepseek-v3:2:1:fused",  # the layout a CUDA engine picks for DeepSeek-V3 at EP 1
    "deepseek-v3:4:4",
    "kimi-k2:2:1",
    "kimi-k2:4:2",
    "qwen3-fp8:2:1",
    "deepseek-v3-fp8:2:1",
]


# --------------------------------------------------------------------------- FP8 weights
def fp8_hf_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random FP8 block-quantized checkpoint: every 2-D linear weight except
    embeddings, lm_head and the router becomes float8_e4m3fn plus a float32
    ``weight_scale_inv`` [ceil(out/128), ceil(in/128)]."""
    bn, bk = cfg["quantization_config"]["weight_block_size"]
    w = sglang_cpu.random_hf_weights(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for n, t in w.items():
        skip = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
        if t.dim() == 2 and not any(s in n for s in skip):
            out[n] = t.to(torch.float8_e4m3fn)
            rows, cols = -(-t.shape[0] // bn), -(-t.shape[1] // bk)
            out[n + "_scale_inv"] = torch.rand(rows, cols, generator=g) + 0.5
        else:
            out[n] = t
    return out


# --------------------------------------------------------------------------- expected layout
class Layout:
    """Expected engine tensors for one rank, computed by hand from HF tensors."""

    def __init__(
        self,
        cfg: dict,
        hf: dict[str, torch.Tensor],
        tp: int,
        rank: int,
        ep: int,
        fused: bool = False,
    ):
        self.cfg, self.hf, self.tp, self.r, self.ep = cfg, hf, tp, rank, ep
        self.fused = fused  # shared expert fused into the routed experts (slot E)
        self.moe_tp = tp // ep
        self.moe_tp_rank = rank % self.moe_tp
        self.moe_ep_rank = rank // self.moe_tp
        q = cfg.get("quantization_config")
        self.block = q["weight_block_size"] if q else None

    # helpers
    @staticmethod
    def rows(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
        per = t.shape[0] // n
        return t[i * per : (i + 1) * per]

    @staticmethod
    def cols(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
        per = t.shape[1] // n
        return t[:, i * per : (i + 1) * per]

    def _scale_rows(self, s: torch.Tensor, i: int, n: int) -> torch.Tensor:
        return self.rows(s, i, n)

    def vocab(self, t: torch.Tensor) -> torch.Tensor:
        v = t.shape[0]
        pad = 64
        if (-(-v // pad) * pad) % self.tp:
            pad *= self.tp
        padded = -(-v // pad) * pad
        per = padded // self.tp
        out = torch.zeros((per, *t.shape[1:]), dtype=t.dtype)
        lo, hi = self.r * per, min((self.r + 1) * per, v)
        if hi > lo:
            out[: hi - lo] = t[lo:hi]
        return out

    def kv(self, t: torch.Tensor, nkv: int) -> torch.Tensor:
        """k or v rows (or their block scales) for this rank; replicated when tp > nkv."""
        if nkv >= self.tp:
            return self.rows(t, self.r, self.tp)
        head = self.r // (self.tp // nkv)
        return self.rows(t, head, nkv)

    def expected(self, name: str) -> torch.Tensor | None:
        cfg, hf, tp, r = self.cfg, self.hf, self.tp, self.r
        if name in hf and ("norm" in name or name.endswith("mlp.gate.weight")):
            return hf[name]  # replicated
        if name.endswith("e_score_correction_bias"):
            return hf[name].float()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab(hf.get(name, hf["model.embed_tokens.weight"]))  # tied: no lm_head
        pre, _, leaf = name.rpartition(".")
        scale = leaf.endswith("weight_scale_inv")
        suffix = "." + leaf
        if pre.endswith("self_attn.qkv_proj"):
            a = pre[: -len("qkv_proj")]
            nkv = cfg["num_key_value_heads"]
            return torch.cat(
                [
                    self.rows(hf[a + "q_proj" + suffix], r, tp),
                    self.kv(hf[a + "k_proj" + suffix], nkv),
                    self.kv(hf[a + "v_proj" + suffix], nkv),
                ]
            )
        if pre.endswith("gate_up_proj"):
            m = pre[: -len("gate_up_proj")]
            return torch.cat(
                [
                    self.rows(hf[m + "gate_proj" + suffix], r, tp),
                    self.rows(hf[m + "up_proj" + suffix], r, tp),
                ]
            )
        if pre.endswith(("o_proj", "down_proj")):
            return self.cols(hf[name], r, tp)  # scale_inv: block columns
        if pre.endswith("fused_qkv_a_proj_with_mqa"):
            a = pre[: -len("fused_qkv_a_proj_with_mqa")]
            return torch.cat([hf[a + "q_a_proj" + suffix], hf[a + "kv_a_proj_with_mqa" + suffix]])
        if pre.endswith(("q_b_proj", "kv_b_proj", "self_attn.q_proj")):
            return self.rows(hf[name], r, tp)
        if pre.endswith("mlp.experts"):
            m = pre[: -len("experts")]
            E = cfg.get("num_experts") or cfg["n_routed_experts"]
            local = E // self.ep
            experts = range(self.moe_ep_rank * local, (self.moe_ep_rank + 1) * local)
            mt, mr = self.moe_tp, self.moe_tp_rank
            per = []
            slots = [f"{m}experts.{e}." for e in experts]
            if self.fused:
                slots.append(f"{m}shared_experts.")
            for x in slots:
                if leaf.startswith("w13"):
                    sfx = ".weight_scale_inv" if scale else ".weight"
                    per.append(
                        torch.cat(
                            [
                                self.rows(hf[x + "gate_proj" + sfx], mr, mt),
                                self.rows(hf[x + "up_proj" + sfx], mr, mt),
                            ]
                        )
                    )
                else:
                    sfx = ".weight_scale_inv" if scale else ".weight"
                    per.append(self.cols(hf[x + "down_proj" + sfx], mr, mt))
            return torch.stack(per)
        return None

    def derived(self, model: torch.nn.Module, name: str) -> torch.Tensor | None:
        """MLA's w_kc / w_vc, derived by post_load_weights from kv_b_proj."""
        if not name.endswith(("self_attn.w_kc", "self_attn.w_vc")):
            return None
        attn = name.rsplit(".", 1)[0]
        kvb = self.rows(self.hf[attn + ".kv_b_proj.weight"], self.r, self.tp)
        if kvb.dtype == torch.float8_e4m3fn:
            # CPU path of post_load_weights: block scales -> one per-tensor scale
            # (on CUDA with 128x128 blocks it dequantizes to bf16 instead).
            from sglang.srt.layers.quantization.fp8_utils import block_quant_to_tensor_quant

            s = self.rows(self.hf[attn + ".kv_b_proj.weight_scale_inv"], self.r, self.tp)
            kvb, _ = block_quant_to_tensor_quant(kvb, s, self.block)
        nope, vd = self.cfg["qk_nope_head_dim"], self.cfg["v_head_dim"]
        w_kc, w_vc = kvb.unflatten(0, (-1, nope + vd)).split([nope, vd], dim=1)
        return w_kc if name.endswith("w_kc") else w_vc.transpose(1, 2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


# --------------------------------------------------------------------------- one case
def run_case(spec: str, show: bool) -> bool:
    name, tp_s, ep_s, *flags = spec.split(":")
    tp, ep = int(tp_s), int(ep_s)
    fused = "fused" in flags
    extra_args: dict[str, object] = {"enforce_shared_experts_fusion": True} if fused else {}
    cfg = CONFIGS[name]
    hf = fp8_hf_weights(cfg) if "quantization_config" in cfg else sglang_cpu.random_hf_weights(cfg)
    ok_all = True
    fused_tag = " fused-shared-experts" if fused else ""
    print(f"=== {name} tp={tp} ep={ep}{fused_tag} arch={cfg['architectures'][0]}")
    for rank in range(tp):
        t0 = time.perf_counter()
        model = sglang_cpu.build_model(cfg, tp_size=tp, tp_rank=rank, ep_size=ep, **extra_args)
        t1 = time.perf_counter()
        sglang_cpu.load_hf_weights(model, hf.items())
        t2 = time.perf_counter()
        lay = Layout(cfg, hf, tp, rank, ep, fused)
        checked, bad, unchecked = 0, [], []
        for n, t in sglang_cpu.engine_tensors(model):
            exp = lay.expected(n)
            tag = ""
            if exp is None:
                unchecked.append(n)
                tag = "  (not from HF: derived buffer, unchecked)"
            elif _same(t, exp):
                checked += 1
            else:
                bad.append(n)
                tag = f"  MISMATCH expected {tuple(exp.shape)} {exp.dtype}"
            if show:
                print(f"  r{rank} {n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{tag}")
        for n, t in sglang_cpu.extra_tensor_attrs(model):
            exp = lay.derived(model, n)
            tag = "  (derived attribute)"
            if exp is not None:
                if _same(t, exp):
                    checked += 1
                    tag += " ok"
                else:
                    bad.append(n)
                    tag += " MISMATCH"
            if show:
                print(f"  r{rank} {n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{tag}")
        ok = not bad
        kinds = ", ".join(sorted({u.rsplit(".", 1)[-1] for u in unchecked}))
        ok_all &= ok
        print(
            f"  rank {rank}/{tp}: build {t1 - t0:.2f}s load {t2 - t1:.3f}s; "
            f"{checked} tensors bitwise as expected, {len(bad)} mismatched, "
            f"{len(unchecked)} unchecked ({kinds or '-'})" + ("" if ok else f"  BAD: {bad}")
        )
    return ok_all


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--all", action="store_true", help="also the extra families")
    ap.add_argument("--quiet", action="store_true", help="no per-tensor listing")
    ap.add_argument("--case", action="append", help="name:tp:ep[:fused] (repeatable)")
    a = ap.parse_args()
    cases = a.case or (REQUIRED + (EXTRA if a.all else []))
    t0 = time.perf_counter()
    results = {}
    for c in cases:
        try:
            results[c] = run_case(c, show=not a.quiet)
        except Exception as e:  # report and continue with the other cases
            import traceback

            traceback.print_exc()
            print(f"  FAILED {c}: {type(e).__name__}: {e}")
            results[c] = False
    print(f"--- {sum(results.values())}/{len(results)} cases ok in {time.perf_counter() - t0:.1f}s")
    for c, ok in results.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {c}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
