"""Why deterministic eviction cannot certify itself, and why the randomized design can (docs/METHOD.md).

Theorem (non-identifiability). For one attention head with query q, keys k_i and values v_i, the full
output is o = Σ_i w_i v_i / Σ_i w_i with w_i = exp(q·k_i · scale). A deterministic eviction policy
(SnapKV, H2O, TOVA, Knorm, StreamingLLM, ...) keeps the top-B tokens of a score that does not depend on
the evicted values. Moving every evicted value v_j to v_j + c·u therefore leaves the retained set, every
retained tensor and every estimate computed from them unchanged, while the true output moves to
o(c) = o(0) + c · Σ_{j evicted} (w_j / Σw) u: the error ‖ô − o(c)‖ grows linearly in c. No function of
the retained state, a certificate included, can be a consistent estimate of the error.

Under the randomized design (Poisson sampling with known inclusion probabilities π), the Horvitz–Thompson
sums over the retained set S,

    N̂ = Σ_{i∈S} (w_i/π_i) v_i,      D̂ = Σ_{i∈S} w_i/π_i,

are unbiased for N = Σ_i w_i v_i and D = Σ_i w_i, whatever the evicted values are; ô = N̂/D̂ is the Hájek
estimator that the logit offset −log π computes, and its linearized variance is the certificate.

``nonidentifiability_demo`` and ``horvitz_thompson_unbiasedness`` show both facts on real attention
(one layer of a real model on a real prompt); ``python -m kvcert.theory`` prints a short report on the
bundled SmolLM2 model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from .designs import DesignOptions, get_design
from .estimator import certificate, hajek_attention
from .generation import prefill
from .policies import LayerView, get_policy
from .sampling import inclusion_probabilities, poisson_sample, retained_count

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
LABELS = ("red", "blue", "green", "silver", "golden", "purple", "orange", "violet")


def passkey_prompt(n_noise: int = 24, n_needles: int = 4, seed: int = 0) -> tuple[str, str, str]:
    """A RULER-style pass-key prompt: (context, question, answer).

    The context repeats the noise paragraph ``n_noise`` times (about 24 tokens each) with ``n_needles``
    sentences "The {label} pass key is {5 digits}." at seeded positions; the question asks for one label.
    """
    rng = random.Random(seed)
    labels = rng.sample(LABELS, n_needles)
    keys = [f"{rng.randrange(10_000, 100_000)}" for _ in labels]
    paragraphs = [NOISE] * n_noise
    slots = sorted(rng.sample(range(1, n_noise + n_needles), n_needles))
    for slot, label, key in zip(slots, labels, keys):
        paragraphs.insert(slot, f"The {label} pass key is {key}.")
    target = rng.randrange(n_needles)
    question = f"\nWhat is the {labels[target]} pass key? The {labels[target]} pass key is"
    return " ".join(paragraphs), question, keys[target]


@dataclass
class LayerState:
    """One layer of a real prefill, as the theory functions use it.

    keys, values: (kv_heads, n, d) post-RoPE; window_queries: (q_heads, w, d); query: (q_heads, d), the
    last prompt position's query; scale: the layer's attention scale.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    query: torch.Tensor
    scale: float
    sliding_window: int | None = None

    @property
    def group(self) -> int:
        return self.query.shape[0] // self.keys.shape[0]

    def view(self, values: torch.Tensor | None = None) -> LayerView:
        return LayerView(
            keys=self.keys[None],
            values=(self.values if values is None else values)[None],
            window_queries=self.window_queries[None],
            accumulated_attention=None,
            scale=self.scale,
            sliding_window=self.sliding_window,
        )

    def logits(self) -> torch.Tensor:
        """(kv_heads, group, n) float64 logits of the query heads grouped by KV head."""
        q = self.query.double().reshape(self.keys.shape[0], self.group, -1)
        return torch.matmul(q, self.keys.double().transpose(-1, -2)) * self.scale


def layer_state(model, tokenizer, prompt: str, layer: int, observation_window: int = 16) -> LayerState:
    """Prefill ``prompt`` and return layer ``layer``'s keys, values and queries (batch 1, squeezed)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    state = prefill(model, ids, observation_window=observation_window)
    lyr = state.cache.layers[layer]
    obs = state.observations[layer]
    return LayerState(
        keys=lyr.keys[0].detach().float(),
        values=lyr.values[0].detach().float(),
        window_queries=obs.window_queries[0].float(),
        query=obs.window_queries[0, :, -1, :].float(),
        scale=float(obs.scale),
        sliding_window=obs.sliding_window,
    )


def _attend(state: LayerState, values: torch.Tensor, log_pi: torch.Tensor, keep: torch.Tensor | None = None):
    """Hájek attention of the last query over the slots ``keep`` (all when None); float64.

    values: (kv_heads, n, d); log_pi: (kv_heads, n). Returns out (kv_heads, group, d), var (same).
    """
    lp = log_pi.double() if keep is None else torch.where(keep, log_pi.double(), torch.tensor(float("-inf"), dtype=torch.float64))
    q = state.query.double().reshape(state.keys.shape[0], state.group, -1)
    return hajek_attention(q, state.keys.double(), values.double(), lp, scale=state.scale)


@dataclass
class NonIdentifiability:
    """Result of ``nonidentifiability_demo``.

    scales: the c values; true_err: ‖ô − o(c)‖ per c (all query heads of the layer concatenated);
    slope_theory: ‖Σ_{evicted} a_j u‖, the asymptotic slope; slope_fit, intercept_fit, r2: a least-squares
    line through the (c, error) points with c ≥ ``fit_from``; retained_identical: whether the selection,
    the retained keys/values/log π, ô and the certificate were bit-identical for every c;
    increment_ratio: ‖e(c) − e(0)‖ / (c · slope_theory) for c > 0, e(c) = ô − o(c): exactly 1 by the theorem
    (the error vector moves by −c Σ_evicted a_j u).
    """

    layer: int
    budget: float
    policy: str
    scales: list[float]
    true_err: list[float]
    estimate_norm: float
    certificate: float
    slope_theory: float
    slope_fit: float
    intercept_fit: float
    r2: float
    retained_identical: bool
    evicted_mass: float
    n_tokens: int
    n_retained: int
    fit_from: float
    increment_ratio: list[float]


def nonidentifiability_demo(
    model,
    tokenizer,
    prompt: str | None = None,
    *,
    layer: int = 10,
    budget: float = 0.25,
    scales=(0, 1, 2, 4, 8, 16, 32, 64),
    policy: str = "snapkv",
    seed: int = 0,
    fit_from: float = 4.0,
    state: LayerState | None = None,
) -> NonIdentifiability:
    """Perturb the values that a deterministic top-k design evicted by c·u and watch what changes.

    The policy's scores are recomputed from the perturbed layer for every c, so the demonstration covers
    the policy itself, not only the attention. u is a fixed random unit vector (per KV head).
    """
    if state is None:
        context, question, _ = passkey_prompt() if prompt is None else (prompt, "", "")
        state = layer_state(model, tokenizer, context + question, layer)
    pol = get_policy(policy)
    design = get_design("topk")
    g = torch.Generator().manual_seed(seed)
    h, n, d = state.values.shape
    u = torch.randn(h, 1, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)

    def seeded() -> torch.Generator:  # a fresh generator per draw: every c sees the same sketch and sample
        return torch.Generator().manual_seed(seed)

    base = design(pol.score(state.view(), seeded()), budget, DesignOptions(), generator=seeded())
    evicted = torch.ones(h, n, dtype=torch.bool)
    evicted.scatter_(-1, base.index[0], False)
    reference = None
    errors, error_vectors, identical = [], [], True
    for c in scales:
        values = state.values + float(c) * u * evicted.unsqueeze(-1).float()
        sel = design(pol.score(state.view(values), seeded()), budget, DesignOptions(), generator=seeded())
        index = sel.index[0]
        kept_k = state.keys.gather(1, index.unsqueeze(-1).expand(-1, -1, d))
        kept_v = values.gather(1, index.unsqueeze(-1).expand(-1, -1, d))
        log_pi = sel.log_pi[0]
        q = state.query.double().reshape(h, state.group, -1)
        est, var = hajek_attention(q, kept_k.double(), kept_v.double(), log_pi.double(), scale=state.scale)
        cert = certificate(var.sum(), 0.05)
        full, _ = _attend(state, values, torch.zeros(h, n))
        error_vectors.append(est - full)
        errors.append(float((est - full).norm()))
        snapshot = (index, kept_k, kept_v, log_pi, est, cert)
        if reference is None:
            reference = snapshot
        else:
            identical &= all(torch.equal(a, b) for a, b in zip(reference, snapshot))

    # Asymptotic slope: ‖Σ_evicted a_j u‖ over all query heads, a = full softmax weights.
    a = torch.softmax(state.logits(), dim=-1)  # (h, group, n)
    mass = (a * evicted.unsqueeze(1).double()).sum(-1, keepdim=True)  # (h, group, 1)
    slope_theory = float((mass * u.double()).norm())
    cs, errs = np.asarray(scales, dtype=float), np.asarray(errors)
    fit = cs >= fit_from
    slope, intercept = np.polyfit(cs[fit], errs[fit], 1)
    pred = slope * cs[fit] + intercept
    ss_res = float(((errs[fit] - pred) ** 2).sum())
    ss_tot = float(((errs[fit] - errs[fit].mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    return NonIdentifiability(
        layer=layer,
        budget=budget,
        policy=policy,
        scales=[float(c) for c in scales],
        true_err=errors,
        estimate_norm=float(reference[4].norm()),
        certificate=float(reference[5]),
        slope_theory=slope_theory,
        slope_fit=float(slope),
        intercept_fit=float(intercept),
        r2=r2,
        retained_identical=bool(identical),
        evicted_mass=float(mass.mean()),
        n_tokens=n,
        n_retained=int(reference[0].shape[-1]),
        fit_from=float(fit_from),
        increment_ratio=[
            float((e - error_vectors[0]).norm()) / (c * slope_theory)
            for c, e in zip(scales[1:], error_vectors[1:])
            if c > 0
        ],
    )


@dataclass
class Unbiasedness:
    """Result of ``horvitz_thompson_unbiasedness`` (one scalar each for numerator and denominator).

    numerator: Σ_S (w_i/π_i)(v_i·r) summed over the layer's query heads, r a fixed random unit direction per
    KV head; denominator: Σ_S w_i/π_i summed likewise (w normalized by each head's largest logit).
    *_truth: the full-cache sums; *_mean / *_se: mean and standard error over the draws; *_z: (mean − truth)/se.
    hajek_rel_bias: ‖mean over draws of ô − o‖ / ‖o‖ for the Hájek ratio ô = N̂/D̂ (small, not exactly zero).
    """

    layer: int
    budget: float
    draws: int
    numerator_truth: float
    numerator_mean: float
    numerator_se: float
    numerator_z: float
    denominator_truth: float
    denominator_mean: float
    denominator_se: float
    denominator_z: float
    hajek_rel_bias: float
    mean_retained: float
    expected_retained: float
    extra: dict = field(default_factory=dict)


def horvitz_thompson_unbiasedness(
    model,
    tokenizer,
    prompt: str | None = None,
    *,
    layer: int = 10,
    budget: float = 0.25,
    draws: int = 2000,
    policy: str = "snapkv",
    seed: int = 0,
    state: LayerState | None = None,
) -> Unbiasedness:
    """Monte-Carlo check that the Horvitz–Thompson numerator and denominator are unbiased under Poisson sampling.

    π comes from ``inclusion_probabilities`` on the policy's scores at ``budget`` (a fraction of the prompt),
    exactly as the ``poisson`` design computes it; ``draws`` independent Poisson samples are drawn.
    """
    if state is None:
        context, question, _ = passkey_prompt() if prompt is None else (prompt, "", "")
        state = layer_state(model, tokenizer, context + question, layer)
    h, n, d = state.values.shape
    pol = get_policy(policy)
    opts = DesignOptions()
    count = retained_count(budget, n, opts.n_sink, opts.n_recent)
    scores = pol.score(state.view(), torch.Generator().manual_seed(seed))[0]  # (h, n)
    pi = inclusion_probabilities(
        scores, count, n_sink=opts.n_sink, n_recent=opts.n_recent,
        head_fraction=opts.head_fraction if pol.certain_top_slice else 0.0, pi_min=opts.pi_min,
    ).double()
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(h, d, generator=g, dtype=torch.float64)
    r = r / r.norm(dim=-1, keepdim=True)
    logits = state.logits()  # (h, group, n)
    w = torch.exp(logits - logits.amax(-1, keepdim=True)).sum(1)  # (h, n): summed over the group's heads
    proj = torch.einsum("hnd,hd->hn", state.values.double(), r)  # (h, n)
    num_truth = float((w * proj).sum())
    den_truth = float(w.sum())
    full_out = (torch.softmax(logits, -1).unsqueeze(-1) * state.values.double().unsqueeze(1)).sum(-2)  # (h, group, d)

    nums, dens, counts = [], [], []
    hajek_sum = torch.zeros_like(full_out)
    chunk = 250
    done = 0
    while done < draws:
        b = min(chunk, draws - done)
        keep = poisson_sample(pi.expand(b, h, n), g).double()  # (b, h, n)
        ht = keep / pi  # 1_S / π
        nums.append(((ht * w * proj).sum((-1, -2))))
        dens.append(((ht * w).sum((-1, -2))))
        counts.append(keep.sum(-1).mean(-1))
        hw = ht.unsqueeze(2) * torch.exp(logits - logits.amax(-1, keepdim=True)).unsqueeze(0)  # (b, h, group, n)
        est = torch.einsum("bhgn,hnd->bhgd", hw, state.values.double()) / hw.sum(-1, keepdim=True)
        hajek_sum += est.sum(0)
        done += b
    nums, dens = torch.cat(nums), torch.cat(dens)
    n_se = float(nums.std() / np.sqrt(draws))
    d_se = float(dens.std() / np.sqrt(draws))
    hajek_mean = hajek_sum / draws
    return Unbiasedness(
        layer=layer,
        budget=budget,
        draws=draws,
        numerator_truth=num_truth,
        numerator_mean=float(nums.mean()),
        numerator_se=n_se,
        numerator_z=(float(nums.mean()) - num_truth) / n_se if n_se > 0 else 0.0,
        denominator_truth=den_truth,
        denominator_mean=float(dens.mean()),
        denominator_se=d_se,
        denominator_z=(float(dens.mean()) - den_truth) / d_se if d_se > 0 else 0.0,
        hajek_rel_bias=float((hajek_mean - full_out).norm() / full_out.norm()),
        mean_retained=float(torch.cat(counts).mean()),
        expected_retained=float(pi.sum(-1).mean()),
    )


def main(argv: list[str] | None = None) -> int:
    """Print the two demonstrations on the bundled SmolLM2 model and a pass-key prompt."""
    import argparse

    from .models import load_model

    parser = argparse.ArgumentParser(prog="python -m kvcert.theory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    context, question, answer = passkey_prompt()
    state = layer_state(model, tokenizer, context + question, args.layer)
    demo = nonidentifiability_demo(model, tokenizer, layer=args.layer, budget=args.budget, state=state)
    print(f"Non-identifiability (policy {demo.policy}, top-k at budget {demo.budget}, layer {demo.layer}, "
          f"{demo.n_retained}/{demo.n_tokens} tokens kept per KV head)")
    print("  evicted values moved by c·u; retained state, estimate and certificate bit-identical:",
          demo.retained_identical)
    print(f"  estimate ‖ô‖ = {demo.estimate_norm:.4f}, certificate = {demo.certificate:.4f} for every c")
    for c, err in zip(demo.scales, demo.true_err):
        print(f"  c = {c:5.1f}   true error ‖ô − o(c)‖ = {err:.4f}")
    print(f"  slope fit on c >= {demo.fit_from:g}: {demo.slope_fit:.4f} (R² = {demo.r2:.6f}); "
          f"theory ‖Σ_evicted a_j u‖ = {demo.slope_theory:.4f}")
    print(f"  ‖e(c) − e(0)‖ / (c · theory slope): {min(demo.increment_ratio):.6f} .. {max(demo.increment_ratio):.6f}")
    ht = horvitz_thompson_unbiasedness(
        model, tokenizer, layer=args.layer, budget=args.budget, draws=args.draws, state=state
    )
    print(f"Horvitz–Thompson under Poisson sampling ({ht.draws} draws, budget {ht.budget}, layer {ht.layer}; "
          f"mean retained {ht.mean_retained:.1f} vs expected {ht.expected_retained:.1f})")
    print(f"  numerator   truth {ht.numerator_truth:+.5f}  mean {ht.numerator_mean:+.5f}  "
          f"se {ht.numerator_se:.5f}  z {ht.numerator_z:+.2f}")
    print(f"  denominator truth {ht.denominator_truth:.5f}  mean {ht.denominator_mean:.5f}  "
          f"se {ht.denominator_se:.5f}  z {ht.denominator_z:+.2f}")
    print(f"  Hájek ratio: relative bias of the mean estimate {ht.hajek_rel_bias:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
