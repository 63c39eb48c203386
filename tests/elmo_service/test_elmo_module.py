"""``elmo_service.Elmo`` and ``batch_to_ids``: AllenNLP's contract, held to AllenNLP itself.

The AllenNLP side is ``allennlp.modules.elmo`` 2.10.1 (``tests/install_parity_deps.sh``;
a missing AllenNLP fails, it never skips), on random-weight bilm-tf files
(``tests/support/bilm_fixtures.py``). Without AllenNLP: gradients against the float64
reference (``tests/support/reference.py``), which kernel each mode runs, bad input.
"""

from __future__ import annotations

import pytest
import torch

from elmo_service import Elmo, batch_to_ids
from elmo_service.bilm.char_ids import batch_ids, sentence_ids
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.lstm import LstmpFunction
from elmo_service.bilm.model import BiLM
from elmo_service.errors import ArtifactError, ConfigError, InputError
from tests.support import reference
from tests.support.allennlp_shim import allennlp_fixture  # noqa: F401 (allennlp)
from tests.support.bilm_fixtures import write_bilm
from tests.support.core_fixtures import tiny_artifact, tiny_model

SENTENCES = [
    ["The", "bank", "of", "the", "river", "flooded", "again", "."],
    ["naïve", "café", "日本語", "😀", "Straße"],
    [],
    ["a"],
    ["x" * 60, "é" * 30, "a" + "😀" * 13, "<S>", "</S>", "", " ", "\u200b", "\ud800"],
]
TOL = 1e-5  # float rounding: the two sides sum in different orders


# --------------------------------------------------------------------------- AllenNLP
@pytest.fixture(scope="module")
def bilm_files(tmp_path_factory):
    return write_bilm(tmp_path_factory.mktemp("bilm"), n_characters=262, n_highway=2, seed=5)


def _gate_order(w: torch.Tensor) -> torch.Tensor:
    """AllenNLP's gate blocks (i, f, g, o) in this project's order (i, f, o, g)."""
    i, f, g, o = w.chunk(4, dim=0)
    return torch.cat([i, f, o, g])


def bilm_grads(theirs, ours: BiLM) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, AllenNLP's gradient, ours) for every kind of biLM weight."""
    enc, lstm = theirs._elmo_lstm._token_embedder, theirs._elmo_lstm._elmo_lstm
    pairs = [
        # a 262-row file's last row is never read (ids stop at 261): AllenNLP keeps it
        (
            "char_embed",
            enc._char_embedding_weights.grad[:262],
            ours.token_encoder.char_embed.weight.grad,
        ),
        ("conv 2", enc.char_conv_2.weight.grad, ours.token_encoder.convs[2].weight.grad),
        ("projection", enc._projection.weight.grad, ours.token_encoder.projection.weight.grad),
        ("highway bias", None, None),
    ]
    hw = enc._highways._layers[1]
    n = hw.bias.shape[0] // 2  # AllenNLP stores the carry gate negated
    theirs_b = torch.cat([hw.bias.grad[:n], -hw.bias.grad[n:]])
    pairs[-1] = ("highway bias", theirs_b, ours.token_encoder.highways[1].bias.grad)
    for d, layers in (("forward", ours.forward_layers), ("backward", ours.backward_layers)):
        for k, layer in enumerate(layers):
            cell = getattr(lstm, f"{d}_layer_{k}")
            pairs += [
                (
                    f"{d}{k} w_ih",
                    _gate_order(cell.input_linearity.weight.grad),
                    layer.w_ih.weight.grad,
                ),
                (
                    f"{d}{k} w_hh",
                    _gate_order(cell.state_linearity.weight.grad),
                    layer.w_hh.weight.grad,
                ),
                (f"{d}{k} bias", _gate_order(cell.state_linearity.bias.grad), layer.w_ih.bias.grad),
                (f"{d}{k} w_proj", cell.state_projection.weight.grad, layer.w_proj.weight.grad),
            ]
    return pairs


def _run(elmo, ids, seed=0):
    out = elmo(ids)
    g = torch.Generator().manual_seed(seed)
    loss = sum((r * torch.randn(r.shape, generator=g)).sum() for r in out["elmo_representations"])
    loss.backward()
    return out


@pytest.mark.slow
def test_batch_to_ids_equals_allennlp(allennlp):
    assert torch.equal(batch_to_ids(SENTENCES), allennlp.batch_to_ids(SENTENCES))
    long = [["w" * n for n in range(1, 70)], ["é" * n for n in range(1, 40)]]
    assert torch.equal(batch_to_ids(long), allennlp.batch_to_ids(long))
    assert batch_to_ids([[]]).shape == (1, 0, 50)  # AllenNLP: (1, 0), which its Elmo refuses


@pytest.mark.slow
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize(
    ("do_layer_norm", "keep_sentence_boundaries"), [(False, False), (True, False), (True, True)]
)
def test_outputs_masks_and_gradients_equal_allennlp(
    allennlp, bilm_files, requires_grad, do_layer_norm, keep_sentence_boundaries
):
    options, weights = bilm_files
    kw = {
        "requires_grad": requires_grad,
        "do_layer_norm": do_layer_norm,
        "keep_sentence_boundaries": keep_sentence_boundaries,
        "dropout": 0.5,
    }
    theirs = allennlp.Elmo(str(options), str(weights), 2, **kw).eval()
    ours = Elmo(options, weights, 2, **kw).eval()
    # two mixes that differ, so each is checked on its own (AllenNLP: a parameter per layer)
    with torch.no_grad():
        for p, v in zip(theirs.scalar_mix_1.scalar_parameters, [0.5, -1.0, 2.0], strict=True):
            p.fill_(v)
        theirs.scalar_mix_1.gamma.fill_(1.7)
        ours.scalar_mix_1.scalars.copy_(torch.tensor([0.5, -1.0, 2.0]))
        ours.scalar_mix_1.gamma.fill_(1.7)
    ids = batch_to_ids(SENTENCES)
    a, b = _run(theirs, ids), _run(ours, ids)
    assert ours.get_output_dim() == theirs.get_output_dim() == 32
    assert torch.equal(a["mask"], b["mask"]) and a["mask"].dtype == b["mask"].dtype == torch.bool
    assert len(b["elmo_representations"]) == 2
    for x, y in zip(a["elmo_representations"], b["elmo_representations"], strict=True):
        assert x.shape == y.shape
        assert (x - y).abs().max() <= TOL * max(1.0, float(x.detach().abs().max()))
    r0, r1 = b["elmo_representations"]
    assert (r0 - r1).abs().max() > 0.1  # k independent mixes
    for k in (0, 1):
        mix_a, mix_b = getattr(theirs, f"scalar_mix_{k}"), getattr(ours, f"scalar_mix_{k}")
        grad_a = torch.cat([p.grad for p in mix_a.scalar_parameters])
        assert (grad_a - mix_b.scalars.grad).abs().max() <= 1e-4 * grad_a.abs().max()
        assert abs(float(mix_a.gamma.grad) - float(mix_b.gamma.grad)) <= 1e-4 * abs(
            float(mix_a.gamma.grad)
        )
    if requires_grad:
        for name, ga, gb in bilm_grads(theirs, ours._elmo_lstm):
            scale = float(ga.abs().max())
            assert scale > 0, name
            assert (ga - gb).abs().max() <= 1e-4 * scale, name
    else:
        assert all(p.grad is None for p in ours._elmo_lstm.parameters())


@pytest.mark.slow
def test_scalar_mix_parameters_and_extra_leading_dims(allennlp, bilm_files):
    options, weights = bilm_files
    fixed = [-9e10, 1, -9e10]  # AllenNLP's example: layer 1 alone
    theirs = allennlp.Elmo(str(options), str(weights), 1, scalar_mix_parameters=fixed).eval()
    ours = Elmo(options, weights, 1, scalar_mix_parameters=fixed).eval()
    assert not any(p.requires_grad for p in ours.parameters())
    ids = batch_to_ids(SENTENCES[:4]).reshape(2, 2, -1, 50)  # [2, 2, T, 50]
    a, b = theirs(ids), ours(ids)
    assert a["mask"].shape == b["mask"].shape == ids.shape[:3]
    assert (a["elmo_representations"][0] - b["elmo_representations"][0]).abs().max() <= TOL
    full, lengths = batch_ids(SENTENCES[:4])
    with torch.no_grad():
        layers = ours._elmo_lstm(torch.from_numpy(full), torch.from_numpy(lengths))
    want = layers[1][:, 1:-1].reshape(2, 2, -1, 32) * b["mask"].unsqueeze(-1)
    assert (b["elmo_representations"][0] - want).abs().max() <= TOL


@pytest.mark.slow
def test_stateful_carries_the_state_row_by_row_as_allennlp(allennlp, bilm_files):
    options, weights = bilm_files
    theirs = allennlp.Elmo(str(options), str(weights), 1, requires_grad=True, dropout=0.0)
    ours = Elmo(options, weights, 1, requires_grad=True, dropout=0.0, stateful=True)
    zero = Elmo(options, weights, 1, dropout=0.0)
    batches = [  # growing, shrinking, and rows of other lengths than before
        SENTENCES[:2],
        [["x", "y"], ["naïve", "café", "z"], ["new", "row"]],
        [["one"]],
        [["p", "q", "r"], ["s"], ["t", "u", "v", "w"]],
    ]
    for k, sentences in enumerate(batches):
        ids = batch_to_ids(sentences)
        a = theirs(ids)["elmo_representations"][0]
        b = ours(ids)["elmo_representations"][0]
        z = zero(ids)["elmo_representations"][0].detach()
        assert (a - b).abs().max() <= TOL, k
        # the default starts every sentence from zero: only the first batch agrees
        assert ((a - z).abs().max() <= TOL) == (k == 0), k
    # with the state reset, the first batch again gives its first answer
    theirs._elmo_lstm._elmo_lstm.reset_states()
    ours.reset_states()
    ids = batch_to_ids(batches[0])
    first = zero(ids)["elmo_representations"][0]
    assert (ours(ids)["elmo_representations"][0] - first).abs().max() <= TOL
    # a frozen stateful module (the inference loop) carries the same state
    frozen = Elmo(options, weights, 1, dropout=0.0, stateful=True)
    for sentences in batches:
        with torch.no_grad():
            got = frozen(batch_to_ids(sentences))["elmo_representations"][0]
    assert (got - b.detach()).abs().max() <= TOL


# --------------------------------------------------------------------------- without AllenNLP
@pytest.fixture
def model():
    return tiny_model(filters=((1, 4), (2, 8), (3, 8)), cell_clip=0.8, proj_clip=0.5, n_highway=1)


def test_gradients_equal_the_float64_reference(model):
    sentences = [s for s in SENTENCES if s]
    elmo = Elmo(None, None, 1, bilm=model, requires_grad=True, dropout=0.0)
    out = elmo(batch_to_ids(sentences))
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(out["elmo_representations"][0].shape, generator=g)
    (out["elmo_representations"][0] * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss = 0
    for b, sentence in enumerate(sentences):  # the textbook biLM, one sentence at a time
        ids = torch.from_numpy(sentence_ids(sentence, model.cfg.max_chars_per_token))
        layers = reference.bilstm(
            model, reference.char_cnn(model, ids, torch.float64), torch.float64
        )
        mix = layers.mean(0)[1:-1]  # AllenNLP's start: equal weights, gamma 1
        loss = loss + (mix * weights[b, : len(sentence)].double()).sum()
    loss.backward()
    assert len(ours) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max())
        assert (ours[name] - p.grad).abs().max() <= 1e-4 * max(scale, 1e-3), name


def test_frozen_runs_the_serving_kernel_and_only_the_mixes_learn(model, monkeypatch):
    calls = {"fused": 0, "serving": 0}
    real_apply, real_ctx = LstmpFunction.apply, CpuBiLM.contextualize

    def fused(*args):
        calls["fused"] += 1
        return real_apply(*args)

    def serving(self, *args, **kwargs):
        calls["serving"] += 1
        return real_ctx(self, *args, **kwargs)

    monkeypatch.setattr(LstmpFunction, "apply", fused)
    monkeypatch.setattr(CpuBiLM, "contextualize", serving)
    elmo = Elmo(None, None, 2, bilm=model).train()
    out = elmo(batch_to_ids(SENTENCES))
    sum(r.sum() for r in out["elmo_representations"]).backward()
    assert calls == {"fused": 0, "serving": 1}  # one biLM run for both mixes, no autograd
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in elmo.scalar_mix_0.parameters())
    # fine-tuning: the fused training kernel, every layer and direction, padding or not
    tuned = Elmo(None, None, 1, bilm=tiny_model(), requires_grad=True).train()
    tuned(batch_to_ids(SENTENCES))["elmo_representations"][0].sum().backward()
    n_layers = 2 * tuned._elmo_lstm.cfg.n_layers
    assert calls["fused"] == n_layers and calls["serving"] == 1
    assert tuned._elmo_lstm.dropout.p == 0.0  # the pretraining dropout is off unless asked


def test_reset_states_zeroes_the_rows_asked(model):
    elmo = Elmo(None, None, 1, bilm=model, dropout=0.0, stateful=True)
    zero = Elmo(None, None, 1, bilm=model, dropout=0.0)
    ids = batch_to_ids(SENTENCES[:2])
    first = zero(ids)["elmo_representations"][0]
    elmo(ids)
    elmo.reset_states(torch.tensor([True, False]))  # row 0 starts afresh, row 1 carries on
    again = elmo(ids)["elmo_representations"][0]
    assert (again[0] - first[0]).abs().max() <= TOL
    assert (again[1] - first[1]).abs().max() > 1e-3
    with pytest.raises(InputError, match="mask has 3 rows"):
        elmo.reset_states(torch.tensor([True, False, True]))


def test_cached_vocabulary_gives_the_character_cnn_answer(model):
    vocab = ["@@PADDING@@", "The", "bank", "of", "the", "river", "."]
    cached = Elmo(None, None, 1, bilm=model, dropout=0.0, vocab_to_cache=vocab)
    plain = Elmo(None, None, 1, bilm=model, dropout=0.0)
    sentences = [["The", "bank", "of", "the", "river", "."], ["the", "river"]]
    words = torch.tensor([[1, 2, 3, 4, 5, 6], [4, 5, 0, 0, 0, 0]])
    ids = batch_to_ids(sentences)
    a = cached(ids, words)
    b = plain(ids)
    assert torch.equal(a["mask"], b["mask"])
    diff = a["elmo_representations"][0] - b["elmo_representations"][0]
    assert diff.abs().max() <= TOL


def test_dropout_only_in_train_mode(model):
    elmo = Elmo(None, None, 1, bilm=model, dropout=0.5)
    ids = batch_to_ids(SENTENCES)
    plain = Elmo(None, None, 1, bilm=model, dropout=0.0).eval()(ids)["elmo_representations"][0]
    evaluated = elmo.eval()(ids)["elmo_representations"][0]
    assert torch.equal(evaluated, plain)
    torch.manual_seed(0)
    trained = elmo.train()(ids)["elmo_representations"][0].detach()
    kept = trained != 0
    real = plain != 0
    assert 0.3 < float((kept & real).sum() / real.sum()) < 0.7
    assert torch.allclose(trained[kept], 2 * plain[kept], atol=1e-6)


def test_from_pretrained_reads_an_artifact_and_its_tokenizer(tmp_path):
    directory = tiny_artifact(tmp_path / "m")
    elmo = Elmo.from_pretrained(directory, 2, dropout=0.0)
    tokens = [t.piece for t in elmo.tokenizer("The bank, of the river.")]
    out = elmo(batch_to_ids([tokens]))
    assert out["elmo_representations"][0].shape == (1, len(tokens), elmo.get_output_dim())
    assert out["mask"].all()


@pytest.mark.parametrize(
    ("call", "field", "words"),
    [
        (lambda: batch_to_ids("one sentence"), "batch", "list of token lists"),
        (lambda: batch_to_ids([["a"], "b c"]), "batch[1]", "not a list of tokens"),
        (lambda: batch_to_ids([["a", 3]]), "batch[0][1]", "not a str"),
        (lambda: batch_to_ids([]), "batch", "no sentences"),
    ],
)
def test_bad_batches_are_one_line_errors(call, field, words):
    with pytest.raises(InputError) as info:
        call()
    assert info.value.field == field and words in str(info.value) and "\n" not in str(info.value)


def test_bad_char_ids_and_options_are_one_line_errors(model, tmp_path):
    elmo = Elmo(None, None, 1, bilm=model)
    ids = batch_to_ids([["a", "b"], ["c"]])
    gap = ids.clone()
    gap[0, 0] = 0  # a padding token before a real one
    for bad, words in [
        ([[1, 2, 3]], "LongTensor"),
        (ids.float(), "integer tensor"),
        (ids[..., :20], "characters per token"),
        (ids + 300, "0..261"),
        (gap, "row 0 has a padding token"),
    ]:
        with pytest.raises(InputError) as info:
            elmo(bad)
        assert words in str(info.value) and "\n" not in str(info.value), words
        assert info.value.field == "char_ids"
    options, weights = write_bilm(tmp_path, n_characters=262)
    broken = tmp_path / "broken.json"
    broken.write_text('{"lstm": {"dim": 32}}')
    with pytest.raises(ConfigError) as info:
        Elmo(broken, weights, 1)
    assert info.value.field == "char_cnn" and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        Elmo(tmp_path / "missing.json", weights, 1)
    with pytest.raises(ArtifactError, match="does not exist"):
        Elmo(options, tmp_path / "missing.hdf5", 1)
    with pytest.raises(ConfigError, match="scalar_mix_parameters needs 3"):
        Elmo(options, weights, 1, scalar_mix_parameters=[1.0, 2.0])


def test_the_migration_guide_tagger_trains(tmp_path):
    """docs/library.md's tagger, run as written, on a small weights file."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "library.md").read_text()
    section = text[text.index("### A tagger that trains") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    options, weights = write_bilm(tmp_path, n_characters=262, n_highway=1)
    code = code.replace(
        '"elmo_2x1024_128_2048cnn_1xhighway_options.json"', repr(str(options))
    ).replace('"elmo_2x1024_128_2048cnn_1xhighway_weights.hdf5"', repr(str(weights)))
    assert str(options) in code and str(weights) in code
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, "docs/library.md", "exec"), scope)
    losses = scope["losses"]
    assert len(losses) == 20 and losses[-1] < 0.75 * losses[0]  # 1.55 -> 0.94 (dropout 0.5)
