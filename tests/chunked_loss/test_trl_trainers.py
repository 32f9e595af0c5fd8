"""TRL's trainers with ``use_liger_kernel=True`` against the same trainers with it off.

TRL 1.0 - 1.12 import this package's fused losses into their trainer modules and call them
when ``use_liger_kernel=True``: ``DPOTrainer`` -> :class:`LigerFusedLinearDPOLoss`,
``KTOTrainer`` -> :class:`LigerFusedLinearKTOLoss`, ``GRPOTrainer`` ->
:class:`LigerFusedLinearGRPOLoss`, ``DistillationTrainer`` and the experimental ``GKDTrainer``
-> :class:`LigerFusedLinearJSDLoss` (KTO by 1.9, distillation by 1.12). TRL 1.13 and later
no longer call them. A trainer whose module does not hold our class (TRL missing, or a TRL that
does not call it) is skipped with that reason; the detection is the module attribute itself, so
no version list is kept. Within the ``trl`` extra's range a TRL whose DPO or GRPO trainer does
not hold ours fails instead (``test_a_trl_in_the_pinned_range_calls_the_fused_losses``), so CI
cannot skip these tests silently.

Each test trains a tiny random-initialised Llama (built here, offline) for a few SGD steps on
a tiny in-memory dataset, once with the fused loss and once with TRL's own loss from the same
initial weights and seed, on CPU in float32, and compares every step's logged loss, gradient
norm and loss-specific metrics, and the trained weights. ``use_liger_kernel=True`` also makes
transformers' ``Trainer`` patch the model's layers (RMSNorm, RoPE, SwiGLU), so the comparison
covers what a user switches on with that flag. Every test also counts the fused loss's calls,
so a trainer that silently fell back to its own loss fails.

Tolerance: fp32 (eps 1.2e-7). The two runs differ in summation order (chunked log-softmax of a
fused head versus materialised logits, Triton versus torch layers); sequence log-probabilities
are sums of ~10 token terms of magnitude ~4, so they agree to ~1e-6 absolute, and the losses,
gradient norms and metrics built from them to a few 1e-6 (observed: at most 5e-6 absolute on
losses up to 11, 1e-6 relative on gradient norms up to 80). SGD (not Adam, whose normalised update turns
rounding noise in a near-zero gradient into a full-size step) keeps the trained weights within
``lr *`` the gradient difference (observed < 2e-7). ``atol=rtol=2e-5`` leaves a 10x margin;
a wrong sign, normalisation or missing term moves these numbers by 1e-3 or more (a 1%
change of ``beta`` in any of the four losses fails its test).

Metrics TRL computes differently on its two paths (documented, not compared): ``logits/*``
(TRL's own path averages over completion tokens, the fused losses return the mean, or for KTO
the sum, over every position and vocabulary entry) and ``entropy``/``mean_token_accuracy``
(logged only without liger).
"""

from __future__ import annotations

import importlib

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from liger_kernel.chunked_loss import (  # noqa: E402
    LigerFusedLinearDPOLoss,
    LigerFusedLinearGRPOLoss,
    LigerFusedLinearJSDLoss,
    LigerFusedLinearKTOLoss,
)
from tests.transformers.model_configs import build_model  # noqa: E402
from tests.utils import DEVICE  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-5)
STEPS = 2

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2 = tiny_config's pad, bos, eos
_WORDS = ("the a cat dog sat ran on mat big red blue is was good bad yes no hello world what color sky grass "
          "green answer question tree sun moon fast slow up down user assistant").split()
# One turn per role, each closed by the eos token, for the trainers that read conversations.
_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                  "{% if add_generation_prompt %}assistant {% endif %}")
_VOCAB = _SPECIALS + _WORDS + [f"w{i}" for i in range(96 - len(_SPECIALS) - len(_WORDS))]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``_VOCAB`` (96 ids) with a chat template, built offline."""
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(_VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=_CHAT_TEMPLATE)


def _model(seed: int, **overrides):
    return build_model("llama", seed=seed, vocab=len(_VOCAB), **overrides)


def _trainer_module_calls(module_name: str, loss_cls: type):
    """Skip unless ``trl.<module_name>`` imported our ``loss_cls`` (then it calls it); return the module."""
    try:
        module = importlib.import_module(f"trl.{module_name}")
    except ImportError as exc:
        pytest.skip(f"trl {trl.__version__}: trl.{module_name} does not import ({exc})")
    if getattr(module, loss_cls.__name__, None) is not loss_cls:
        pytest.skip(f"trl {trl.__version__}'s {module_name} does not call liger_kernel.chunked_loss."
                    f"{loss_cls.__name__} (TRL >= 1.13 dropped the fused losses; earlier 1.x releases call "
                    "them once they find liger-kernel installed)")
    return module


def test_a_trl_in_the_pinned_range_calls_the_fused_losses():
    """Within the ``trl`` extra's range the tests below must run, not skip: every TRL 1.x before 1.13
    calls the fused DPO and GRPO losses once it finds liger-kernel (its check reads the installed
    distribution's version, which must reach TRL's minimum)."""
    from packaging.version import Version

    if not Version("1.0") <= Version(trl.__version__) < Version("1.13"):
        pytest.skip(f"trl {trl.__version__} is outside the trl extra's range (>=1.0,<1.13)")
    pairs = (("dpo_trainer", LigerFusedLinearDPOLoss), ("grpo_trainer", LigerFusedLinearGRPOLoss))
    for name, loss_cls in pairs:
        module = importlib.import_module(f"trl.trainer.{name}")
        assert getattr(module, loss_cls.__name__, None) is loss_cls, (
            f"trl {trl.__version__}'s {name} did not import our {loss_cls.__name__}: TRL judged liger-kernel "
            "unavailable (is the package installed, e.g. pip install -e ., not only on PYTHONPATH?)")


def _common_args(tmp_path, liger: bool, seed: int) -> dict:
    return dict(
        output_dir=str(tmp_path / ("liger" if liger else "trl")), use_liger_kernel=liger, seed=seed,
        data_seed=seed, max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False,
        use_cpu=DEVICE == "cpu", dataloader_num_workers=0, disable_tqdm=True,
    )


def _train(trainer, liger: bool, loss_cls: type):
    """Train; return the per-step log rows, the initial and the trained parameters. With liger, check
    the fused loss is the trainer's and ran once a step."""
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    calls = []
    if liger:
        assert type(trainer.liger_loss) is loss_cls
        trainer.liger_loss.register_forward_hook(lambda *_: calls.append(1))
    trainer.train()
    if liger:
        assert len(calls) == STEPS, f"the fused loss ran {len(calls)} times in {STEPS} steps"
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == STEPS
    return rows, initial, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _assert_same_training(plain, fused, keys):
    """``keys`` (``plain_key: fused_key`` where TRL names a metric differently on its two paths) agree at
    every step that logs them (each at least once; GRPO logs rewards on generation steps only), and so do
    the trained weights."""
    (plain_rows, initial, plain_params), (fused_rows, fused_initial, fused_params) = plain, fused
    keys = {k: k for k in keys} if not isinstance(keys, dict) else keys
    seen = set()
    for step, (p_row, f_row) in enumerate(zip(plain_rows, fused_rows, strict=True), start=1):
        for p_key, f_key in keys.items():
            assert (p_key in p_row) == (f_key in f_row), (step, p_key, sorted(p_row), sorted(f_row))
            if p_key not in p_row:
                continue
            seen.add(p_key)
            torch.testing.assert_close(torch.tensor(f_row[f_key]), torch.tensor(p_row[p_key]), **TOL,
                                       msg=lambda m, s=step, k=f_key: f"step {s}, {k}: {m}")
    assert seen == keys.keys(), f"never logged: {sorted(keys.keys() - seen)}"
    assert plain_params.keys() == fused_params.keys() == initial.keys()
    for name, value in plain_params.items():
        assert torch.equal(fused_initial[name], initial[name]), f"{name}: the runs started apart"
        assert not torch.equal(value, initial[name]), f"{name} did not train"
        torch.testing.assert_close(fused_params[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")


_PROMPTS = ["the cat", "what color is the sky", "hello", "the dog"]
_PAIRS = dict(
    prompt=_PROMPTS,
    chosen=[" sat on the mat", " blue", " world", " ran fast"],
    rejected=[" ran on a red mat", " green grass", " no", " is bad"],
)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "apo_down", "sppo_hard"])
def test_dpo_trainer(tmp_path, _fresh_seed, loss_type):
    """``sigmoid`` (TRL's default); ``ipo`` normalises by each completion's token count; ``apo_down``
    mixes the chosen log-ratio with the margin; ``sppo_hard`` squares the log-ratios (cancellation)."""
    _trainer_module_calls("trainer.dpo_trainer", LigerFusedLinearDPOLoss)
    tok, data = _tokenizer(), Dataset.from_dict(_PAIRS)

    def run(liger):
        args = trl.DPOConfig(per_device_train_batch_size=2, beta=0.5, loss_type=[loss_type],
                             **_common_args(tmp_path, liger, _fresh_seed))
        # a reference unlike the policy, so the first step's rewards and loss are not trivially 0 / log 2
        trainer = trl.DPOTrainer(model=_model(_fresh_seed), ref_model=_model(_fresh_seed + 1), args=args,
                                 train_dataset=data, processing_class=tok)
        return _train(trainer, liger, LigerFusedLinearDPOLoss)

    keys = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected"]
    _assert_same_training(run(False), run(True), keys)


def test_kto_trainer(tmp_path, _fresh_seed):
    """Desirable and undesirable completions mixed in each batch of 3, with TRL's KL estimate."""
    _trainer_module_calls("trainer.kto_trainer", LigerFusedLinearKTOLoss)
    tok = _tokenizer()
    data = Dataset.from_dict(dict(
        prompt=_PROMPTS + ["the cat", "hello"],
        completion=[" sat on the mat", " blue", " world", " ran", " is bad", " no"],
        label=[True, True, False, True, False, False],
    ))

    def run(liger):
        args = trl.KTOConfig(per_device_train_batch_size=3, beta=0.5,
                             **_common_args(tmp_path, liger, _fresh_seed))
        trainer = trl.KTOTrainer(model=_model(_fresh_seed), ref_model=_model(_fresh_seed + 1), args=args,
                                 train_dataset=data, processing_class=tok)
        return _train(trainer, liger, LigerFusedLinearKTOLoss)

    keys = ["loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "logps/chosen", "logps/rejected"]
    _assert_same_training(run(False), run(True), keys)


def _reward(completions, **_):
    """A position-weighted character sum: two different completions almost never tie, so a group's
    advantages are not all 0 (word counts tied often enough to leave a whole step untrained)."""
    return [sum((i + 1) * ord(ch) for i, ch in enumerate(c)) % 1009 / 1009 for c in completions]


@pytest.mark.parametrize("loss_type, level, clip_key", [
    ("dapo", "token", "clip_ratio/region_mean"),
    ("grpo", "sequence", "clip_ratio/region_mean"),
    ("cispo", "token", "cispo_clip_ratio"),
    ("vespo", "token", None),
])
def test_grpo_trainer(tmp_path, _fresh_seed, loss_type, level, clip_key):
    """One generation of 4 samples of 5 tokens, trained on twice (``num_iterations=2``): the first step
    is on-policy (ratio 1), the second has old log-probs, so the ratio is clipped; ``beta=0.1`` loads a
    reference (from the saved model: TRL builds it from the model's path) for the KL term. The rewards
    must agree too: they show both runs sampled the same completions. With sequence-level ratios TRL's
    own ``clip_ratio/region_mean`` counts clipped sequences where the fused loss (as the best-known
    library's) counts their tokens; completions of equal length (no eos before the fifth token) make the
    two the same number."""
    _trainer_module_calls("trainer.grpo_trainer", LigerFusedLinearGRPOLoss)
    tok, data = _tokenizer(), Dataset.from_dict({"prompt": _PROMPTS})
    path = tmp_path / "model"
    _model(_fresh_seed).to("cpu").save_pretrained(path)
    tok.save_pretrained(path)

    # Sequence-level clip ratios agree only when every completion has the same length: no early eos.
    generation_kwargs = {"min_new_tokens": 5} if level == "sequence" else None

    def run(liger):
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=5,
                              num_iterations=2, beta=0.1, loss_type=loss_type,
                              importance_sampling_level=level, generation_kwargs=generation_kwargs,
                              **_common_args(tmp_path, liger, _fresh_seed))
        trainer = trl.GRPOTrainer(model=str(path), reward_funcs=_reward, args=args, train_dataset=data,
                                  processing_class=tok)
        return _train(trainer, liger, LigerFusedLinearGRPOLoss)

    keys = {"loss": "loss", "grad_norm": "grad_norm", "kl": "kl", "reward": "reward"}
    if clip_key is not None:
        keys[clip_key] = "clip_ratio"
    _assert_same_training(run(False), run(True), keys)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_trainer(tmp_path, _fresh_seed, beta):
    """On-policy distillation with the generalised JSD (``beta`` 0: forward KL, 1: reverse KL), from a
    teacher with larger weights so the divergence is far from 0."""
    _trainer_module_calls("trainer.distillation_trainer", LigerFusedLinearJSDLoss)
    tok, data = _tokenizer(), Dataset.from_dict({"prompt": _PROMPTS})

    def run(liger):
        args = trl.DistillationConfig(per_device_train_batch_size=2, max_completion_length=5, beta=beta,
                                      **_common_args(tmp_path, liger, _fresh_seed))
        teacher = _model(_fresh_seed + 1, initializer_range=1.0)
        trainer = trl.DistillationTrainer(model=_model(_fresh_seed), teacher_model=teacher, args=args,
                                          train_dataset=data, processing_class=tok)
        return _train(trainer, liger, LigerFusedLinearJSDLoss)

    _assert_same_training(run(False), run(True), ["loss", "grad_norm"])


def test_dpo_trainer_exo_pair_is_refused_clearly(tmp_path, _fresh_seed):
    """TRL requires ``label_smoothing > 0`` for ``exo_pair`` but does not pass it to the fused loss, whose
    constructor then refuses the loss type by name instead of training a different loss."""
    _trainer_module_calls("trainer.dpo_trainer", LigerFusedLinearDPOLoss)
    args = trl.DPOConfig(per_device_train_batch_size=2, loss_type=["exo_pair"], label_smoothing=1e-3,
                         **_common_args(tmp_path, True, _fresh_seed))
    with pytest.raises(ValueError, match="exo_pair.*label_smoothing"):
        trl.DPOTrainer(model=_model(_fresh_seed), ref_model=_model(_fresh_seed + 1), args=args,
                       train_dataset=Dataset.from_dict(_PAIRS), processing_class=_tokenizer())


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_gkd_trainer(tmp_path, _fresh_seed, lmbda):
    """TRL's experimental GKD trainer (an SFT trainer over conversations): ``lmbda=0`` trains on the
    dataset's answers, ``lmbda=1`` on the student's own 5-token samples."""
    gkd = _trainer_module_calls("experimental.gkd.gkd_trainer", LigerFusedLinearJSDLoss)
    tok = _tokenizer()
    answers = ["sat on the mat", "blue", "world", "ran fast"]
    turns = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
             for p, a in zip(_PROMPTS, answers, strict=True)]
    data = Dataset.from_dict({"messages": turns})

    def run(liger):
        from trl.experimental.gkd import GKDConfig

        args = GKDConfig(per_device_train_batch_size=2, max_new_tokens=5, max_length=32, lmbda=lmbda,
                         beta=0.5, **_common_args(tmp_path, liger, _fresh_seed))
        teacher = _model(_fresh_seed + 1, initializer_range=1.0)
        trainer = gkd.GKDTrainer(model=_model(_fresh_seed), teacher_model=teacher, args=args,
                                 train_dataset=data, processing_class=tok)
        return _train(trainer, liger, LigerFusedLinearJSDLoss)

    _assert_same_training(run(False), run(True), ["loss", "grad_norm"])
