"""``maestro.hf``'s KD loss against a hand-written tempered KL (issue 35).

The student's per-sample loss is ``sum over targets of CE + alpha * T^2 * KL(p_T || p_S)``
with both distributions softened by ``T``; with ``top_k`` the teacher sends its k largest
logits per token and ``p_T`` is the softmax of those over ``T``, compared with the student's
full tempered distribution at the same token ids. Positions without a target (``-100``)
have neither term. Everything expected is computed here from the two models' raw logits.
"""

import pytest
import torch
from test_hf_sections import build, llama, tokens

from maestro import hf

ALPHA, T = 0.7, 3.0


def hand_written(student_logits, teacher_logits, target, top_k):
    """One sample's loss from ``(N, V)`` logits, position by position."""
    total = torch.zeros((), dtype=torch.float64)
    for n in range(target.numel()):
        y = int(target[n])
        if y == -100:
            continue
        s, t = student_logits[n], teacher_logits[n]
        total = total + torch.logsumexp(s, 0) - s[y]  # CE
        log_q = s / T - torch.logsumexp(s / T, 0)  # the student's tempered log-probs, all V
        if top_k:
            order = sorted(range(t.numel()), key=lambda v: -float(t[v]))[:top_k]
            ids = torch.tensor(order)
            z = t[ids] / T  # the teacher's k largest logits, softened
        else:
            ids = torch.arange(t.numel())
            z = t / T
        log_p = z - torch.logsumexp(z, 0)
        kl = (log_p.exp() * (log_p - log_q[ids])).sum()
        total = total + ALPHA * T**2 * kl
    return total


@pytest.mark.parametrize("top_k", [0, 4, 64])
def test_kd_student_loss_is_ce_plus_tempered_top_k_kl_float64(top_k):
    """``hf.kd_sections(alpha=, temperature=, top_k=)``'s teacher and student sections."""
    g = torch.Generator().manual_seed(1)
    t_sec, s_sec = hf.kd_sections(
        hf.causal_lm(llama()), hf.causal_lm(llama()), alpha=ALPHA, temperature=T, top_k=top_k
    )
    teacher, student = build(t_sec.module), build(s_sec.module)
    with torch.no_grad():  # a sharper teacher: the temperature then changes p_T a lot
        teacher.get_output_embeddings().weight.mul_(4.0)
    labels = tokens(g, 9)
    labels[[2, 5]] = -100  # positions without a target: no CE and no KL
    samples = [
        {"id": 0, "input_ids": tokens(g, 7)},
        {"id": 1, "input_ids": tokens(g, 9), "labels": labels},
    ]
    t_out = t_sec.clone(teacher).run(samples, {})
    got = s_sec.clone(student).run(samples, {"teacher": t_out})
    for i, s in enumerate(samples):
        ids = s["input_ids"][None]
        with torch.no_grad():
            s_logits = student(input_ids=ids).logits[0, :-1]
            t_logits = teacher(input_ids=ids).logits[0, :-1]
        target = s.get("labels", s["input_ids"])[1:]
        want = hand_written(s_logits, t_logits, target, top_k)
        torch.testing.assert_close(got[i]["loss"].detach(), want, rtol=1e-10, atol=1e-12)
    if top_k:  # what travels: the k largest raw logits (the student applies T) and their ids
        vals, idx = t_out[1]["top_values"], t_out[1]["top_indices"]
        with torch.no_grad():
            full = teacher(input_ids=samples[1]["input_ids"][None]).logits[0, :-1]
        assert vals.shape == (8, top_k)
        torch.testing.assert_close(vals, full.gather(-1, idx), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(vals, full.sort(-1, descending=True).values[:, :top_k])
