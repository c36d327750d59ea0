"""Metrics against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from icecache.core.metrics import attention_recall, exact_top_tokens, hit_rate, output_error


def test_hit_rate_hand_case():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    keys = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, -1.0]])
    # group scores (max over heads): [3, 2, 1, -1]; top-2 = positions {0, 1}
    assert exact_top_tokens(q, keys, 2).tolist() == [0, 1]
    assert hit_rate(q, keys, torch.tensor([0, 2]), 2) == 0.5
    assert hit_rate(q, keys, torch.tensor([1, 0, 3]), 2) == 1.0
    assert hit_rate(q, keys, torch.tensor([], dtype=torch.int64), 2) == 0.0
    assert hit_rate(q, keys, torch.tensor([3]), 0) == 1.0
    assert hit_rate(q, keys, torch.tensor([0, 1, 2, 3]), 10) == 1.0  # top-min(B, n)


def test_attention_recall_hand_case():
    q = torch.tensor([[1.0, 0.0]])
    keys = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # scale 1: logits [1, 0, 0] -> p = [e, 1, 1] / (e + 2)
    e = math.e
    assert attention_recall(q, keys, torch.tensor([0]), scale=1.0) == pytest.approx(e / (e + 2))
    assert attention_recall(q, keys, torch.tensor([1, 2, 1]), scale=1.0) == pytest.approx(2 / (e + 2))
    assert attention_recall(q, keys, torch.tensor([0, 1, 2]), scale=1.0) == pytest.approx(1.0)
    # two heads: average of their recalls
    q2 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert attention_recall(q2, keys, torch.tensor([0]), scale=1.0) == pytest.approx((e / (e + 2) + 1 / 3) / 2)
    # default scale is 1/sqrt(d)
    s = 1 / math.sqrt(2)
    assert attention_recall(q, keys, torch.tensor([0])) == pytest.approx(math.exp(s) / (math.exp(s) + 2))


def test_output_error_hand_case():
    q = torch.tensor([[0.0, 0.0]])  # uniform attention
    keys = torch.zeros(2, 2)
    values = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    # full output = [1, 0]; keeping only position 0 -> [2, 0]: error |[1, 0]| / |[1, 0]| = 1
    assert output_error(q, keys, values, torch.tensor([0])) == pytest.approx(1.0)
    assert output_error(q, keys, values, torch.tensor([1])) == pytest.approx(1.0)
    assert output_error(q, keys, values, torch.tensor([0, 1])) == pytest.approx(0.0)
    values3 = torch.tensor([[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # full = [1, 0]; keep {0, 1} -> [1.5, 0] -> error 0.5
    assert output_error(q, torch.zeros(3, 2), values3, torch.tensor([0, 1])) == pytest.approx(0.5)
    assert output_error(q, keys, values, torch.tensor([], dtype=torch.int64)) == 1.0
