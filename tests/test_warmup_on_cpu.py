"""The default's SFT warm-up stops at its target (greedy by default) accuracy, and rejects bad settings."""

from __future__ import annotations

import re

import pytest

from verl_sat.default import data as task
from verl_sat.default import model as tiny
from verl_sat.default import warmup


def tiny_model():
    tokenizer = tiny.build_tokenizer()
    return tiny.build_model(tiny.build_config(tokenizer), seed=0), tokenizer


def test_warmup_stops_at_the_first_check_that_reaches_the_target(monkeypatch):
    accuracies = iter([0.1, 0.2, 0.45, 0.9])
    monkeypatch.setattr(warmup, "sampled_accuracy", lambda *a, **k: next(accuracies))
    model, tokenizer = tiny_model()
    args = warmup.WarmupArgs(steps=50, batch_size=2, check_every=3, target_accuracy=0.4)
    losses = warmup.train(model, tokenizer, args)
    assert len(losses) == 9  # checks after steps 3, 6, 9: the third reaches 0.4


@pytest.mark.parametrize("stop_on", ["greedy", "sampled"])
def test_warmup_stops_on_the_accuracy_it_is_told_to(monkeypatch, stop_on):
    seen = []

    def accuracy(*args, greedy=False, **kwargs):
        seen.append(greedy)
        return 1.0 if greedy == (stop_on == "greedy") else 0.0

    monkeypatch.setattr(warmup, "sampled_accuracy", accuracy)
    model, tokenizer = tiny_model()
    args = warmup.WarmupArgs(steps=20, batch_size=2, check_every=2, target_accuracy=0.5, stop_on=stop_on)
    assert len(warmup.train(model, tokenizer, args)) == 2  # the first check stops it
    assert seen == [stop_on == "greedy"]


def test_the_default_warmup_stops_on_greedy_accuracy():
    # the default's learning curve climbs from the sampled towards the greedy accuracy
    assert warmup.WarmupArgs().stop_on == "greedy"


def test_warmup_without_target_runs_every_step(monkeypatch):
    monkeypatch.setattr(warmup, "sampled_accuracy", lambda *a, **k: 1.0)
    model, tokenizer = tiny_model()
    losses = warmup.train(model, tokenizer, warmup.WarmupArgs(steps=4, batch_size=2, check_every=1, target_accuracy=0))
    assert len(losses) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", 0),
        ("target_accuracy", 1.5),
        ("target_accuracy", -0.1),
        ("check_every", 0),
        ("label_smoothing", 1.0),
        ("label_smoothing", -0.1),
        ("stop_on", "loss"),
    ],
)
def test_bad_warmup_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^WarmupArgs\.{field} must be .*, got {re.escape(repr(value))}$"):
        warmup.WarmupArgs(**{field: value})


def test_response_loss_is_the_models_own_loss_without_smoothing_and_changes_with_it():
    import torch

    model, tokenizer = tiny_model()
    batch = warmup.make_batch(tokenizer, task.sample_problems(4, seed=3))
    with torch.no_grad():
        plain = warmup.response_loss(model, batch, 0.0)
        smoothed = warmup.response_loss(model, batch, 0.1)
        model_loss = model(**batch).loss
    torch.testing.assert_close(plain, model_loss)
    assert not torch.isclose(smoothed, plain)


def test_the_default_warmup_smooths_its_labels():
    # the default run's learning rests on a warm-up that keeps probability on every token
    assert warmup.WarmupArgs().label_smoothing > 0
