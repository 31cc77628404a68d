"""A plain reference for the model-family rules: every SGLang engine tensor of one rank,
built directly from the full HF tensors with torch (slices, torch.cat, zero padding,
torch.stack of experts), written from SGLang's layout as scripts/SGLANG_NOTES.md records
it and independently of weightwire.plan.rules.

FP8: the whole HF tensor is block-quantized first (the FP8 checkpoint SGLang would load),
then its codes and its scales are sliced the way SGLang's loaders slice an FP8
checkpoint (scales in block units). The rules instead quantize each rank's slice, so the
two agree only when every slice is whole blocks, which is what is checked.
"""

from __future__ import annotations

from typing import Any

import torch

from weightwire.client.fp8 import quantize_blocks

# Tiny configs of every family (the published layouts, shrunk).
BASE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1000,  # not a multiple of 64: vocab padding
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DSV3: dict[str, Any] = dict(
    BASE,
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
    rope_scaling=YARN,
    num_nextn_predict_layers=0,
)
QMOE: dict[str, Any] = dict(
    BASE,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
FP8Q = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
BIG = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=4, head_dim=64)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3-tied": dict(
        BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True
    ),
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", head_dim=16),
    "llama": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama-bias": dict(
        BASE, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True
    ),
    "qwen3-moe": QMOE,
    "deepseek-v3": DSV3,
    "kimi-k2": dict(DSV3, model_type="kimi_k2", n_group=1, topk_group=1),
    "deepseek-noqlora": dict(DSV3, q_lora_rank=None),
    # FP8: every rank's slice is whole 128x128 blocks
    "qwen3-fp8": dict(BASE, **BIG, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3-fp8-kvrep": dict(  # 2 kv heads of 128 over tp 4: replicated, still whole blocks
        BASE,
        **dict(BIG, num_key_value_heads=2, head_dim=128),
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        quantization_config=FP8Q,
    ),
    "qwen2-fp8": dict(BASE, **BIG, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "llama-fp8": dict(
        BASE, **BIG, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True
    ),
    "qwen3-moe-fp8": dict(QMOE, **BIG, moe_intermediate_size=256),
    "deepseek-v3-fp8": dict(
        DSV3,
        hidden_size=256,
        intermediate_size=512,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        moe_intermediate_size=256,
        quantization_config=FP8Q,  # dest_dtype "" follows the config: FP8
    ),
}


def family(cfg: dict[str, Any]) -> str:
    arch = cfg["architectures"][0]
    return {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "DeepseekV3ForCausalLM": "deepseek",
    }[arch]


class Reference:
    def __init__(
        self,
        cfg: dict[str, Any],
        hf: dict[str, torch.Tensor],
        tp: int,
        rank: int,
        ep: int = 1,
        fp8: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        qcache: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.cfg, self.hf, self.tp, self.r, self.ep = cfg, hf, tp, rank, ep
        self.block, self.dtype = fp8, dtype
        self.moe_tp = tp // ep
        self.mr = rank % self.moe_tp  # moe tp rank
        self.er = rank // self.moe_tp  # moe ep rank
        self.fam = family(cfg)
        self._q = qcache if qcache is not None else {}  # whole-tensor FP8, shareable by ranks
        self.out: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ helpers
    def t(self, name: str) -> torch.Tensor:
        return self.hf[name].to(self.dtype)

    def qz(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of the whole HF tensor (the FP8 checkpoint)."""
        if name not in self._q:
            assert self.block is not None
            self._q[name] = quantize_blocks(self.hf[name], self.block)
        return self._q[name]

    def put(self, name: str, value: torch.Tensor) -> None:
        assert name not in self.out, name
        self.out[name] = value.contiguous()

    def lin(self, name: str, parts: list[tuple[str, str, int, int]]) -> None:
        """A linear weight: parts (hf name, 'rows'|'cols'|'all', lo, hi), cat on dim 0."""
        if self.block is None:
            self.put(name, torch.cat([self._cut(self.t(n), k, lo, hi) for n, k, lo, hi in parts]))
            return
        b = self.block
        codes, scales = [], []
        for n, k, lo, hi in parts:
            c, s = self.qz(n)
            codes.append(self._cut(c, k, lo, hi))
            scales.append(self._cut(s, k, lo // b, -(-hi // b)))
        self.put(name, torch.cat(codes))
        self.put(name + "_scale_inv", torch.cat(scales))

    @staticmethod
    def _cut(t: torch.Tensor, kind: str, lo: int, hi: int) -> torch.Tensor:
        if kind == "rows":
            return t[lo:hi]
        if kind == "cols":
            return t[:, lo:hi]
        return t

    def rows_of(self, n: int, parts: int, i: int) -> tuple[int, int]:
        assert n % parts == 0
        return i * n // parts, (i + 1) * n // parts

    def vocab(self, name: str, src: str) -> None:
        w = self.t(src)
        v = w.shape[0]
        pad = 64
        if ((v + pad - 1) // pad * pad) % self.tp:
            pad = 64 * self.tp
        padded = (v + pad - 1) // pad * pad
        full = torch.zeros(padded, w.shape[1], dtype=w.dtype)
        full[:v] = w
        self.put(name, full.chunk(self.tp)[self.r])

    # ------------------------------------------------------------------ parts
    def attention_gqa(self, a: str) -> None:
        cfg = self.cfg
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        q0, q1 = self.rows_of(nh * hd, self.tp, self.r)
        if self.tp >= nkv:
            head = self.r * nkv // self.tp
            k0, k1 = head * hd, head * hd + hd
        else:
            k0, k1 = self.rows_of(nkv * hd, self.tp, self.r)
        qkv = [(f"{a}.q_proj.weight", "rows", q0, q1)]
        qkv += [(f"{a}.{x}_proj.weight", "rows", k0, k1) for x in "kv"]
        self.lin(f"{a}.qkv_proj.weight", qkv)
        if self.fam == "qwen2" or cfg.get("attention_bias"):
            bias = [self.t(f"{a}.q_proj.bias")[q0:q1]]
            bias += [self.t(f"{a}.{x}_proj.bias")[k0:k1] for x in "kv"]
            self.put(f"{a}.qkv_proj.bias", torch.cat(bias))
        self.lin(f"{a}.o_proj.weight", [(f"{a}.o_proj.weight", "cols", q0, q1)])
        if self.fam != "qwen2" and cfg.get("attention_bias"):
            self.put(f"{a}.o_proj.bias", self.t(f"{a}.o_proj.bias"))
        if self.fam in ("qwen3", "qwen3_moe"):
            self.put(f"{a}.q_norm.weight", self.t(f"{a}.q_norm.weight"))
            self.put(f"{a}.k_norm.weight", self.t(f"{a}.k_norm.weight"))

    def attention_mla(self, a: str) -> None:
        cfg = self.cfg
        nh = cfg["num_attention_heads"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        h0, h1 = self.rows_of(nh, self.tp, self.r)
        if cfg.get("q_lora_rank"):
            self.lin(
                f"{a}.fused_qkv_a_proj_with_mqa.weight",
                [
                    (f"{a}.q_a_proj.weight", "all", 0, 0),
                    (f"{a}.kv_a_proj_with_mqa.weight", "all", 0, 0),
                ],
            )
            self.put(f"{a}.q_a_layernorm.weight", self.t(f"{a}.q_a_layernorm.weight"))
            q = "q_b_proj"
        else:
            self.lin(
                f"{a}.kv_a_proj_with_mqa.weight", [(f"{a}.kv_a_proj_with_mqa.weight", "all", 0, 0)]
            )
            q = "q_proj"
        self.lin(
            f"{a}.{q}.weight", [(f"{a}.{q}.weight", "rows", h0 * (nope + rope), h1 * (nope + rope))]
        )
        self.lin(
            f"{a}.kv_b_proj.weight",
            [(f"{a}.kv_b_proj.weight", "rows", h0 * (nope + vd), h1 * (nope + vd))],
        )
        self.lin(f"{a}.o_proj.weight", [(f"{a}.o_proj.weight", "cols", h0 * vd, h1 * vd)])
        self.put(f"{a}.kv_a_layernorm.weight", self.t(f"{a}.kv_a_layernorm.weight"))

    def mlp(self, m: str) -> None:
        inter = self.hf[f"{m}.gate_proj.weight"].shape[0]
        i0, i1 = self.rows_of(inter, self.tp, self.r)
        self.lin(
            f"{m}.gate_up_proj.weight",
            [(f"{m}.gate_proj.weight", "rows", i0, i1), (f"{m}.up_proj.weight", "rows", i0, i1)],
        )
        self.lin(f"{m}.down_proj.weight", [(f"{m}.down_proj.weight", "cols", i0, i1)])

    def experts(self, x: str, n: int) -> None:
        local = n // self.ep
        ids = range(self.er * local, (self.er + 1) * local)
        inter = self.hf[f"{x}.0.gate_proj.weight"].shape[0]
        i0, i1 = self.rows_of(inter, self.moe_tp, self.mr)
        per13, per2, s13, s2 = [], [], [], []
        for e in ids:
            g, u, d = (f"{x}.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))
            if self.block is None:
                per13.append(torch.cat([self.t(g)[i0:i1], self.t(u)[i0:i1]]))
                per2.append(self.t(d)[:, i0:i1])
            else:
                b = self.block
                (gc, gs), (uc, us), (dc, ds) = self.qz(g), self.qz(u), self.qz(d)
                per13.append(torch.cat([gc[i0:i1], uc[i0:i1]]))
                s13.append(torch.cat([gs[i0 // b : -(-i1 // b)], us[i0 // b : -(-i1 // b)]]))
                per2.append(dc[:, i0:i1])
                s2.append(ds[:, i0 // b : -(-i1 // b)])
        self.put(f"{x}.w13_weight", torch.stack(per13))
        self.put(f"{x}.w2_weight", torch.stack(per2))
        if self.block is not None:
            self.put(f"{x}.w13_weight_scale_inv", torch.stack(s13))
            self.put(f"{x}.w2_weight_scale_inv", torch.stack(s2))

    # ------------------------------------------------------------------ model
    def build(self) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            if self.fam == "deepseek":
                self.attention_mla(f"{p}.self_attn")
                sparse = (
                    i >= cfg.get("first_k_dense_replace", 0)
                    and i % cfg.get("moe_layer_freq", 1) == 0
                )
                if sparse:
                    self.put(f"{p}.mlp.gate.weight", self.t(f"{p}.mlp.gate.weight"))
                    if cfg.get("topk_method") == "noaux_tc":
                        b = f"{p}.mlp.gate.e_score_correction_bias"
                        self.put(b, self.hf[b].float())
                    self.experts(f"{p}.mlp.experts", cfg["n_routed_experts"])
                    if cfg.get("n_shared_experts"):
                        self.mlp(f"{p}.mlp.shared_experts")
                else:
                    self.mlp(f"{p}.mlp")
            else:
                self.attention_gqa(f"{p}.self_attn")
                if self.fam == "qwen3_moe":
                    self.put(f"{p}.mlp.gate.weight", self.t(f"{p}.mlp.gate.weight"))
                    self.experts(f"{p}.mlp.experts", cfg["num_experts"])
                else:
                    self.mlp(f"{p}.mlp")
            for n in ("input_layernorm", "post_attention_layernorm"):
                self.put(f"{p}.{n}.weight", self.t(f"{p}.{n}.weight"))
        self.put("model.norm.weight", self.t("model.norm.weight"))
        if not cfg.get("tie_word_embeddings"):
            self.vocab("lm_head.weight", "lm_head.weight")
        return self.out


def reference(
    cfg: dict[str, Any],
    hf: dict[str, torch.Tensor],
    tp: int,
    rank: int,
    ep: int = 1,
    fp8: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    qcache: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Every engine tensor of TP rank `rank` (EP over `ep`), by SGLang name. `qcache`
    keeps the whole-tensor FP8 quantization between ranks of one model."""
    return Reference(cfg, hf, tp, rank, ep, fp8, dtype, qcache).build()
