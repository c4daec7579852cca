"""The fast path (``engine=static`` / ``compiled`` / ``frozen``, lit_spec/decoding/fast.py): every decoder stays
token-identical to transformers' ``generate`` on three architectures, with the same counts as on the eager path; the
static cache after a decode holds exactly the committed tokens' keys/values; bad input is refused before work. The
compiled engines (a compile per width, seconds each) run in the slow tier."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import draft_step_on
from random_models import (ARCHS, assert_same_cache, noisy_copy, random_model, random_prompts, reference_greedy,
                           tokens_until_eos)
from test_chimera import chimera, medusa
from test_dflash import dflash
from test_eagle3 import eagle3
from test_hidden_transfer import transfer

import lit_spec.decoding.fast as fast
from lit_spec.decoding import DECODERS, frozen, generate
from lit_spec.decoding import cache as kv
from lit_spec.decoding.draft_heads import chimera_forward
from lit_spec.decoding.draft_step import DraftStep
from lit_spec.decoding.eagle3 import draft_forward
from lit_spec.decoding.fast import FastForward, PackedHead, width_bucket
from lit_spec.decoding.masks import causal
from lit_spec.decoding.state import FastDecodeState
from lit_spec.errors import ConfigError
from lit_spec.measure import forward_ms
from lit_spec.models.draft_heads import DraftVocab

NEW = 40
# widths of one token, of many, with hidden states, and a draft model's engine of its own
FROZEN_DECODERS = ("ar", "jacobi", "eagle3_chain", "speculative")


def decoders(model) -> dict[str, tuple[str, dict]]:
    """Every decoder, with settings that make it draft, fork and roll back within NEW tokens."""
    draft = noisy_copy(model, 0.02)
    return {
        "ar": ("ar", {}), "jacobi": ("jacobi", {"n_tokens": 5}),
        "multiblock": ("multiblock", {"n_tokens": 6, "blocks": 2, "pool_size": 2}),
        "lookahead": ("lookahead", {"window": 3, "ngram": 3, "guesses": 3}),
        "prompt_lookup": ("prompt_lookup", {"num_draft_tokens": 5}),
        "speculative": ("speculative", {"draft_model": draft, "gamma": 3}),
        "tree": ("tree", {"draft_model": draft, "tree": [2, 2, 1]}),
        "ouroboros": ("ouroboros", {"draft_model": draft, "gamma": 3, "window": 3, "ngram": 3}),
        "medusa": ("medusa", {"heads": medusa(model)}), "chimera": ("chimera", {"heads": chimera(model)}),
        "hidden_transfer": ("hidden_transfer", {"transfer": transfer(model)}),
        "eagle3": ("eagle3", {"heads": eagle3(model), "depth": 4, "top_k": 3, "total_tokens": 8}),
        "eagle3_chain": ("eagle3", {"heads": eagle3(model), "tree": [1, 1, 1]}),
        "dflash": ("dflash", {"heads": dflash(model)}),
    }


def test_blocks_run_at_power_of_two_widths():
    assert [width_bucket(q) for q in (1, 2, 3, 4, 5, 8, 9, 60)] == [1, 2, 4, 4, 8, 8, 16, 64]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_decoder_on_the_static_engine_is_identical_to_generate(models, arch):
    model = models[arch]
    ids, mask = random_prompts(1, [9], seed=4)
    ref = reference_greedy(model, ids, mask, NEW)
    for name, (method, params) in decoders(model).items():
        fast = generate(model, ids, method, max_new_tokens=NEW, engine="static", **params)
        assert torch.equal(fast.sequences, ref), name
        assert fast.stats.compile_time == 0.0
        if arch == "llama":     # the same decode, step for step: the engine changes how a forward runs, not the steps
            eager = generate(model, ids, method, max_new_tokens=NEW, **params)
            assert fast.stats.accepted_per_forward == eager.stats.accepted_per_forward, name
    assert model.config._attn_implementation == "sdpa"      # the fast path gives the model its attention back


class Replays:
    """What CUDA graphs do to their outputs, on a CPU and without compiling: after a new step's replay, of any graph
    (they share one memory pool), the outputs of earlier replays are overwritten (here: with NaN, or -1). A forward
    returns a model output; a draft's step (``DraftStep``) a tensor or a tuple of them."""

    def __init__(self):
        self.issued: list[torch.Tensor] = []
        self.count = 0

    def __call__(self, forward):
        def replay(*args):
            for t in self.issued:
                t.fill_(float("nan") if t.is_floating_point() else -1)
            out = forward(*args)
            self.issued, self.count = [], self.count + 1
            if isinstance(out, torch.Tensor):
                return self._issue(out)
            if isinstance(out, tuple):
                return tuple(self._issue(v) for v in out)
            for key, value in out.items():
                if isinstance(value, torch.Tensor):
                    out[key] = self._issue(value)
                elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
                    out[key] = tuple(self._issue(v) for v in value)
            return out
        return replay

    def _issue(self, value: torch.Tensor) -> torch.Tensor:
        self.issued.append(value.detach().clone())
        return self.issued[-1]


def test_every_decoder_on_graphs_that_reuse_their_output_buffers_is_identical_to_generate(models):
    """engine=graphs on a GPU: the head runs inside the graph (no packed head there), and each replay overwrites the
    logits and hidden states of the last (the target's, a draft model's, or EAGLE-3's or DFlash's draft step's).
    Every decoder, drafts and heads included, stays token-identical."""
    model = noisy_copy(models["llama"], 0.0)         # an engine of its own, faked below
    ids, mask = random_prompts(1, [9], seed=4)
    ref = reference_greedy(model, ids, mask, NEW)
    table = decoders(model)
    replays = Replays()
    for role in [model] + [params["draft_model"] for _, params in table.values() if "draft_model" in params]:
        engine = FastForward.of(role, "graphs")
        engine.head = engine.stack = None            # the whole model in the graph, as on a GPU
        engine._run = replays(engine._forward)
    for name, (method, params) in table.items():
        decoder = DECODERS[method](model, engine="graphs", **params)
        for step in decoder.draft_steps():
            step._run = replays(step.fn)
        before = replays.count
        assert torch.equal(decoder.generate(ids, max_new_tokens=NEW).sequences, ref), name
        assert replays.count > before, name           # its forwards went through the replays


@pytest.mark.parametrize("arch", ARCHS)
def test_ar_and_jacobi_decode_a_batch_on_the_fast_path_as_generate_does(models, arch):
    """Collection decodes batches: AR and Jacobi (blocks aligned, as collection runs them, and not) on the static
    engine and on the compiled path's padded widths (the compile skipped), left-padded prompts of three lengths, one
    row ending at EOS early and riding along after, equal ``generate`` row by row, and Jacobi's trajectories equal
    the eager engine's."""
    model = noisy_copy(models[arch], 0.0)          # an engine of its own, its compile skipped below
    ids, mask = random_prompts(3, [5, 9, 7], seed=2)
    eos = reference_greedy(model, ids, mask, NEW)[1, ids.size(1) + 3].item()     # row 1 ends at its 4th token
    ref = reference_greedy(model, ids, mask, NEW, eos_token_id=eos)
    padded = FastForward.of(model, "compiled")
    padded._run = padded._forward
    for method, params in (("ar", {}), ("jacobi", {"n_tokens": 5}),
                           ("jacobi", {"n_tokens": 5, "align_blocks": True, "return_trajectory": True})):
        eager = generate(model, ids, method, NEW, eos, mask, **params)
        for engine in ("static", "compiled"):
            out = generate(model, ids, method, NEW, eos, mask, engine=engine, **params)
            for r in range(3):
                assert tokens_until_eos(out.sequences[r], ids.size(1), eos) == \
                    tokens_until_eos(ref[r], ids.size(1), eos), (method, engine, r)
            assert out.extras.get("trajectories") == eager.extras.get("trajectories"), (method, engine)
    assert {key[3] for key in padded.compile_seconds} == {3}      # one batch shape throughout, finished rows too
    assert {key[4] for key in padded.compile_seconds} == {256}    # the filled positions attended, not the cache's


def test_a_draft_model_decodes_on_an_engine_of_its_own(models):
    """speculative, tree and ouroboros on the static engine run their draft model on its own static cache too: the
    same draft forwards as on the eager engine, and the draft gets its attention back."""
    model = models["qwen2"]
    ids, _ = random_prompts(1, [9], seed=4)
    for name in ("speculative", "tree", "ouroboros"):
        method, params = decoders(model)[name]
        draft = params["draft_model"]
        fast = generate(model, ids, method, max_new_tokens=NEW, engine="static", **params)
        eager = generate(model, ids, method, max_new_tokens=NEW, **params)
        assert FastForward.of(draft, "static").cache_length > 0, name
        assert fast.stats.draft_forwards == eager.stats.draft_forwards > 0, name
        assert draft.config._attn_implementation == "sdpa"


def test_the_static_cache_holds_the_committed_tokens_after_tree_and_chain_rollbacks(models):
    model = models["llama"]
    ids, mask = random_prompts(1, [6], seed=5)
    for name in ("tree", "speculative", "jacobi"):
        method, params = decoders(model)[name]
        out = generate(model, ids, method, max_new_tokens=25, engine="static", **params)
        engine = FastForward.of(model, "static")
        length = int(engine.cache.layers[0].cumulative_length)
        committed = out.sequences[0].tolist()
        # the cache holds everything but the last token (the pending one), trimmed from the static tensors
        cache = _trimmed(engine.cache, length)
        assert_same_cache(cache, model, committed[: length])
        assert length == len(committed) - 1, name


def test_a_reserved_cache_serves_every_shorter_decode_without_growing(models):
    """The bench reserves its longest prompt's cache before warm-up: a later decode never allocates (and, compiled,
    recompiles every width for) a longer one."""
    model = models["qwen2"]
    engine = FastForward.of(model, "static")
    engine.reserve(engine.positions(300, NEW))
    cache, length = engine.cache, engine.cache_length
    assert length == 768        # 300 + 40 + 256 positions, rounded up to a multiple of 256
    for n in (5, 200):
        ids, mask = random_prompts(1, [n], seed=n)
        assert torch.equal(generate(model, ids, "ar", max_new_tokens=NEW, engine="static").sequences,
                           reference_greedy(model, ids, mask, NEW))
        assert engine.cache is cache and engine.cache_length == length


def test_a_forward_is_timed_at_each_width_the_engine_decoded_at_and_the_next_decode_is_unchanged(models):
    """``measure.forward_ms``, the bench's cost of a forward by width: the widths the decodes ran (not the prompt's
    prefill), timed on the engine's own cache, which keeps its size, and after which a decode is as before."""
    model = noisy_copy(models["qwen2"], 0.0)            # an engine of its own: no widths from other tests
    engine = FastForward.of(model, "static")
    ids, mask = random_prompts(1, [9], seed=8)
    generate(model, ids, "jacobi", max_new_tokens=NEW, engine="static", n_tokens=6)
    widths = set(engine.widths)     # blocks of 6, and narrower ones where fewer tokens are left to decode
    assert (6, False) in widths and all(w <= 6 and not hidden for w, hidden in widths)
    cache, length = engine.cache, engine.cache_length
    costs = forward_ms(engine, context=20, repeats=3)
    assert set(costs) == {str(w) for w, _ in widths} and all(ms > 0 for ms in costs.values())
    assert engine.widths == widths and engine.cache is cache and engine.cache_length == length
    assert torch.equal(generate(model, ids, "ar", max_new_tokens=NEW, engine="static").sequences,
                       reference_greedy(model, ids, mask, NEW))


def test_one_half_precision_query_on_a_cpu_is_attended_in_fp32_and_rounded_once():
    """``sdpa_gqa``: a bf16 model's one-token forwards (AR, a draft's steps) attend in fp32 on a CPU, where torch's
    bf16 flash kernel is slowest, and round once at the end; the output keeps the model's dtype and layout."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    mask = torch.zeros(1, 1, 1, 40)
    mask[..., 30:] = torch.finfo(torch.bfloat16).min
    half = [t.to(torch.bfloat16) for t in (q, k, v, mask)]
    out, _ = fast.sdpa_gqa(None, *half, scaling=0.125)
    fp32 = F.scaled_dot_product_attention(*(t.float() for t in half[:3]), attn_mask=half[3].float(), scale=0.125,
                                          enable_gqa=True)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, 9, 64)
    assert torch.equal(out, fp32.to(torch.bfloat16).transpose(1, 2))


def test_the_packed_head_follows_the_weights_it_was_packed_from(models):
    """On a CPU fp32 model the fast path reads logits through oneDNN's packed copy of the LM head: a head trained
    between decodes (the speedup callback's case) is packed again, so the decode follows the new weights."""
    model = noisy_copy(models["llama"], 0.0)
    assert FastForward.of(model, "static").head is not None
    ids, mask = random_prompts(1, [7], seed=6)
    for _ in range(2):
        out = generate(model, ids, "prompt_lookup", max_new_tokens=NEW, engine="static")
        assert torch.equal(out.sequences, reference_greedy(model, ids, mask, NEW))
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)         # in place: the greedy tokens change
    assert PackedHead.of(noisy_copy(model, 0.0).to(torch.bfloat16)) is None    # the model's own head: not fp32


def _trimmed(static, length: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, layer in enumerate(static.layers):
        cache.update(layer.keys[..., :length, :], layer.values[..., :length, :], i)
    return cache


def test_a_block_past_the_end_of_the_static_cache_grows_it():
    """A block wider than the margin the cache was sized with (a decode of 8 new tokens: 9 + 8 + 256 positions, 512
    after rounding) grows the cache, keeping what it held: the block's logits are the model's over the whole
    sequence."""
    model = random_model("mistral", seed=5)              # its own engine: no cache reserved by another test
    engine = FastForward.of(model, "static")
    ids, mask = random_prompts(1, [9], seed=4)
    block = torch.randint(3, 96, (1, 600), generator=torch.Generator().manual_seed(0))
    with engine.attention():
        state = FastDecodeState(engine, model, ids, mask, 8, None)
        state.prefill()
        logits = state.forward(block, causal(600, ids.device))
    with torch.no_grad():
        full = model(torch.cat([ids, block], dim=1)).logits[0, ids.size(1):]
    assert engine.cache_length == 768
    torch.testing.assert_close(logits[0], full, rtol=1e-4, atol=1e-4)     # the prompt's keys came along


def test_batches_unknown_engines_other_attention_and_short_windows_are_refused_before_work(models):
    model = models["llama"]
    ids, mask = random_prompts(2, [5, 7])
    with pytest.raises(ConfigError, match="one at a time"):      # a batch: AR and Jacobi only
        generate(model, ids, "prompt_lookup", attention_mask=mask, engine="static")
    with pytest.raises(ConfigError, match="engine='fast'"):
        generate(model, ids[:1], "ar", engine="fast")
    eager_attention = noisy_copy(model, 0.0)
    eager_attention.set_attn_implementation("eager")
    with pytest.raises(ConfigError, match="attn_implementation=sdpa"):
        generate(eager_attention, ids[:1], "ar", engine="static")
    windowed = random_model("mistral")
    windowed.config.sliding_window = 64      # shorter than the static cache (prompt + new tokens + 256)
    with pytest.raises(ConfigError, match="sliding window is 64"):
        generate(windowed, ids[:1], "ar", engine="static")
    # Hidden Transfer drafts through hooks on the target's layers, which an exported package would not run
    with pytest.raises(ConfigError, match="hidden_transfer: engine=frozen .* choose engine=compiled"):
        generate(model, ids[:1], "hidden_transfer", engine="frozen", transfer=transfer(model))
    assert not FastForward.of(model, "frozen").compile_seconds


def test_frozen_weights_that_change_are_refused_before_a_decode(models):
    """engine=frozen compiles the weights in: a decode after an optimizer step would run the old ones."""
    model = noisy_copy(models["llama"], 0.0)
    engine = FastForward.of(model, "frozen")
    engine.check_frozen_weights()
    engine.check_frozen_weights()                # unchanged: decodes on
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)          # what an optimizer step does
    with pytest.raises(ConfigError, match="engine=compiled"):
        engine.check_frozen_weights()
    assert FastForward.of(model, "compiled").check_frozen_weights() is None    # compiled reads the weights live


def test_a_torch_without_per_call_compile_budgets_compiles_under_dynamo_s_limits_raised(monkeypatch):
    """The GPU image's torch 2.11 has no ``recompile_limit=`` or ``isolate_recompiles=`` on ``torch.compile`` (a
    TypeError there once): the fast path compiles without them, its budget given to dynamo's process-wide limits."""
    calls = []

    def compile_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                     disable=False):
        calls.append({"fullgraph": fullgraph, "dynamic": dynamic, "mode": mode})
        return model

    monkeypatch.setattr(torch, "compile", compile_2_11)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 256)
    step = lambda x: x     # noqa: E731
    assert fast.compile_shapes(step, "graphs", 32) is step
    assert calls == [{"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}]
    assert torch._dynamo.config.recompile_limit == 32
    assert torch._dynamo.config.accumulated_recompile_limit >= 32 * 8


@pytest.mark.parametrize("method", ["eagle3", "dflash", "chimera"])
def test_a_long_prompt_read_padded_fits_the_drafts_static_layers(method):
    """The draft reads a prompt's features at once, padded to a power of two (1100 rows as 2048; Chimera's two a
    token, 2201 as 4096) on the compiled path (here its compiling skipped: ``conftest.draft_step_on``): more rows than
    the target's static cache holds, so the draft's layers are sized for it, and the decode stays identical to
    ``generate``."""
    model = random_model("llama")
    model.config.max_position_embeddings = 2048
    ids, mask = random_prompts(1, [1100], seed=4)
    heads = {"eagle3": eagle3, "dflash": dflash, "chimera": chimera}[method](model)
    decoder = DECODERS[method](model, heads=heads, tree=[1, 1], engine="static")
    decoder.step = draft_step_on(decoder.draft_forward, decoder.draft, "padded")
    assert torch.equal(decoder.generate(ids, max_new_tokens=6).sequences, reference_greedy(model, ids, mask, 6))
    assert decoder.step.layers[0].max_cache_len > FastForward.of(model, "static").cache_length


def test_the_heads_steps_padded_draft_what_they_draft_eagerly(models):
    """Medusa's and Chimera's draft steps on the compiled path's shapes (compiling skipped): Chimera's rows padded
    to a power of two, rolled back each step; both draft what the eager engine drafts, step for step."""
    model = models["qwen2"]
    ids, mask = random_prompts(1, [9], seed=4)
    ref = reference_greedy(model, ids, mask, NEW)
    for method, heads in (("medusa", medusa(model)), ("chimera", chimera(model))):
        eager = generate(model, ids, method, max_new_tokens=NEW, heads=heads)
        decoder = DECODERS[method](model, heads=heads, engine="static")
        decoder.step = draft_step_on(decoder.draft_forward, decoder.draft, "padded")
        out = decoder.generate(ids, max_new_tokens=NEW)
        assert torch.equal(out.sequences, ref) and torch.equal(eager.sequences, ref), method
        assert out.stats.accepted_per_forward == eager.stats.accepted_per_forward, method
        assert decoder.step.compile_seconds, method          # its calls went through the padded step


@pytest.mark.slow
def test_chimeras_frozen_step_drafts_and_caches_what_its_eager_step_does(models):
    """Chimera's draft step frozen (a real compile: the heads' weights constants, their GEMMs autotuned) gives the
    eager step's top-k at every depth and leaves the same keys/values in its static layer; torch 2.13's frozen C++
    GEMM template read the block's key/value slice of its fused weight from the query rows, so every later step
    attended to queries."""
    model = models["qwen2"]
    draft, d = chimera(model).attach(model), model.config.hidden_size
    vocab, embed = DraftVocab(draft, None), model.get_input_embeddings()
    g = torch.Generator().manual_seed(1)
    rows, query, llm = torch.randn(8, d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g)
    allowed = torch.zeros(2, 16, dtype=torch.bool)
    allowed[:, :6], allowed[1, 8] = True, True        # two pad rows seen by no query; depth 2 sees depth 1's n-gram
    drafts = []
    for engine in ("eager", "frozen"):
        layer = kv.static_layer(draft.block, 16, rows)
        with torch.no_grad():
            top = DraftStep(chimera_forward, draft, engine, "chimera")("8/depth2", vocab, embed, layer, rows, query,
                                                                       llm, torch.tensor([5, 7]), allowed, 2, 3)
        drafts.append((top, layer.keys[:, :, :9], layer.values[:, :, :9]))
    (top, keys, values), (frozen_top, frozen_keys, frozen_values) = drafts
    assert torch.equal(frozen_top, top)
    torch.testing.assert_close(frozen_keys, keys)
    torch.testing.assert_close(frozen_values, values)


def test_a_frozen_draft_step_refuses_weights_that_changed(models):
    """EAGLE-3's draft step on engine=frozen compiles the draft's weights in too (here its compiling is skipped): a
    step after they changed is refused, naming compiled, which reads them live."""
    draft = eagle3(models["llama"])
    step = DraftStep(draft_forward, draft, "frozen", "eagle3")
    step._run = step.fn
    cache = kv.static_layer(draft.midlayer.self_attn, 8, draft.fc.weight)
    one = (torch.tensor([1]), torch.zeros(1, draft.hidden_size), torch.tensor([0]), torch.eye(1, 8, dtype=torch.bool),
           None, 2, False)

    def run():
        kv.set_length(cache, 0)
        return step("expand1@8", cache, *one)

    run()
    run()                                         # unchanged: steps on
    with torch.no_grad():
        draft.lm_head.weight.add_(0.01)           # what an optimizer step does
    with pytest.raises(ConfigError, match="engine=compiled"):
        run()


def test_a_model_decoded_on_the_fast_path_is_freed_with_its_last_reference():
    """The engines are kept per model while it lives: its static cache and compiled widths do not keep it alive."""
    model = random_model("llama", layers=1)
    generate(model, random_prompts(1, [9])[0], "ar", max_new_tokens=4, engine="static")
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "engine", "heads"), [("qwen2", "compiled", ("eagle3", "medusa")),
                                                   ("mistral", "compiled", ("dflash", "chimera")),
                                                   ("llama", "graphs", ("eagle3",)), ("qwen2", "frozen", ())],
                         ids=lambda value: ("-".join(value) or "no-heads") if isinstance(value, tuple) else value)
def test_compiled_decoders_are_identical_to_generate(models, arch, engine, heads):
    """Compiled per width (inductor on the CPU; graphs: the same, CUDA graphs aside): AR, a chain, Jacobi and trees
    drafted by EAGLE-3's, DFlash's, Medusa's or Chimera's draft step (compiled too), against ``generate``; frozen (the
    weights as constants, every GEMM autotuned: 20-60 s a width) AR, Jacobi, EAGLE-3's chain (its widths return the
    hidden states too, its draft step frozen too) and speculative decoding (its draft model frozen too). The compile time is counted
    beside the decode, once per new width, the draft's included."""
    model = models[arch] if engine != "frozen" else noisy_copy(models[arch], 0.0)     # frozen: its own engine
    ids, mask = random_prompts(1, [9], seed=4)
    ref = reference_greedy(model, ids, mask, NEW)
    table = decoders(model)
    for name in FROZEN_DECODERS if engine == "frozen" else ("ar", "speculative", "jacobi", *heads):
        method, params = table[name]
        first = generate(model, ids, method, max_new_tokens=NEW, engine=engine, **params)
        again = generate(model, ids, method, max_new_tokens=NEW, engine=engine, **params)
        assert torch.equal(first.sequences, ref) and torch.equal(again.sequences, ref), name
        assert first.stats.compile_time > 0 and again.stats.compile_time == 0, name
        # each model's compiling comes out of its own forwards' seconds (the draft's out of draft_time)
        assert min(first.stats.forward_time, first.stats.draft_time) >= 0, name
    if engine == "frozen":
        check_frozen_packages(model, ids, mask, ref, table)


def check_frozen_packages(model, ids, mask, ref, table):
    """A copy with the same weights (a later process's model) loads every width's package from disk, compiling none,
    and decodes the same; the weights really are constants of the packages: a change behind autograd's back (no
    version bump) is not seen, where read live it gives another output."""
    packages = sorted(frozen.package_dir().iterdir())
    twin = noisy_copy(model, 0.0)
    for name in FROZEN_DECODERS:
        method, params = table[name]
        assert torch.equal(generate(twin, ids, method, max_new_tokens=NEW, engine="frozen", **params).sequences, ref)
    engine = FastForward.of(twin, "frozen")
    assert engine.frozen.loaded == set(engine.compile_seconds) and engine.frozen.loaded
    assert sorted(frozen.package_dir().iterdir()) == packages
    model.model.layers[0].mlp.down_proj.weight.data.zero_()
    changed = reference_greedy(model, ids, mask, NEW)
    assert not torch.equal(changed, ref)
    assert not torch.equal(generate(model, ids, "ar", max_new_tokens=NEW, engine="frozen").sequences, changed)


def test_a_frozen_package_is_named_by_the_weights_and_what_its_code_depends_on():
    """engine=frozen's packages on disk are found again by a model with the same weights, and never by one whose
    weights, dtype or compile options differ."""
    model = random_model("llama", layers=1)
    name = frozen.fingerprint(model, frozen.CPU_OPTIONS)
    assert frozen.fingerprint(noisy_copy(model, 0.0), dict(frozen.CPU_OPTIONS)) == name
    assert frozen.fingerprint(noisy_copy(model, 1e-6), frozen.CPU_OPTIONS) != name
    assert frozen.fingerprint(noisy_copy(model, 0.0).to(torch.bfloat16), frozen.CPU_OPTIONS) != name
    assert frozen.fingerprint(model, frozen.GPU_OPTIONS) != name


def test_a_frozen_package_that_does_not_load_is_compiled_anew(tmp_path, caplog):
    """A package cut short or overwritten (a disk error, a copy from elsewhere) is compiled again, with a warning
    naming it, rather than failing every later frozen decode."""
    broken = tmp_path / "cut.pt2"
    broken.write_bytes(b"PK\x03\x04 not a whole archive")
    assert frozen.FrozenForwards._load(broken) is None
    assert str(broken) in caplog.text and "compiling it anew" in caplog.text
    assert frozen.FrozenForwards._load(tmp_path / "absent.pt2") is None


@pytest.mark.slow
def test_each_engine_compiles_within_a_recompile_limit_of_its_own(monkeypatch):
    """Every engine compiles the one code object (``FastForward._forward``): the widths that engines compiled earlier
    in the process do not count against the next engine's limit (a long test session hit it)."""
    monkeypatch.setattr(fast, "RECOMPILE_LIMIT", 3)
    ids, mask = random_prompts(1, [9], seed=4)
    for seed in (1, 2):                           # three widths each: AR's 1, Jacobi's 4 and its last block's 2
        model = random_model("llama", seed=seed, layers=seed)      # shapes of its own: graphs of its own
        for method, params in (("ar", {}), ("jacobi", {"n_tokens": 4})):
            out = generate(model, ids, method, max_new_tokens=8, engine="compiled", **params)
            assert torch.equal(out.sequences, reference_greedy(model, ids, mask, 8)), (seed, method)
