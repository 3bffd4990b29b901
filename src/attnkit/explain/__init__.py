"""Attention worked by hand: every intermediate of the four steps, written out, and checks of hand work.

The first source article teaches single-head attention by computing a small example by hand:
project the tokens to ``Q, K, V``; (1) similarity ``scores = Q K^T``; (2) scaling by ``1/sqrt(d_k)``;
(3) softmax; (4) the weighted sum of the values.  :func:`trace` does the same computation in float64,
keeps every intermediate in a :class:`Trace`, and printing it walks the four steps with the first row's
arithmetic written term by term.  :func:`explain_softmax` and :func:`explain_weighted_sum` do one step.

:func:`check` compares hand-computed claims with the exact values.  Each claim is read at the precision it
is written in (``0.240`` claims three decimals) and checked twice: against the exact values from the
inputs, and against what follows from the claimed values of the previous steps.  A slip early on is
reported once, where it happened; later steps that follow correctly from it are shown as inherited.

Rows are numbered from 1 in printed text (``x1``, ``Q1``), as in the article; indices in Python and in
claim names (``"scores[0]"``) start at 0.

Example::

    >>> from attnkit import explain
    >>> t = explain.trace(explain.ARTICLE["X"], explain.ARTICLE["W_q"], explain.ARTICLE["W_k"],
    ...                   explain.ARTICLE["W_v"])
    >>> [round(x, 4) for x in t.weights[0].tolist()]
    [0.4498, 0.248, 0.3023]
    >>> print(str(t).splitlines()[0])
    Attention in four steps: L=3 tokens, d_model=4, d_k=2, d_v=2 (computed in float64)
"""

from __future__ import annotations

from typing import Any

from ._claims import CheckReport, ClaimResult, check, load_claims
from ._trace import SoftmaxSteps, Trace, WeightedSum, explain_softmax, explain_weighted_sum, trace

__all__ = [
    "ARTICLE",
    "ARTICLE_CLAIMS",
    "Trace",
    "SoftmaxSteps",
    "WeightedSum",
    "ClaimResult",
    "CheckReport",
    "trace",
    "explain_softmax",
    "explain_weighted_sum",
    "check",
    "load_claims",
]

# The worked example of the first article, section 3: three tokens ("cat chases mouse") in d_model = 4,
# one head with d_k = d_v = 2.
ARTICLE: dict[str, list] = {
    "X": [[1.0, 0.5, -0.2, 1.2], [0.3, -1.0, 0.8, 0.4], [-0.7, 0.6, 1.1, -0.5]],
    "W_q": [[0.1, 0.4], [-0.2, 0.3], [0.5, -0.1], [0.2, 0.1]],
    "W_k": [[-0.3, 0.2], [0.1, 0.5], [0.4, -0.2], [-0.1, 0.3]],
    "W_v": [[0.2, -0.1], [0.3, 0.4], [-0.2, 0.1], [0.5, -0.3]],
}

# The result of every step the article states, transcribed as written (strings keep the written precision):
# section 3 for the example above (Q, K, V and row 1 of each later step), and the one-row softmax and weighted
# sum of sections 2.3 and 2.4.  The arithmetic inside a step (the products, the sum of the exponentials, the
# terms of the weighted sum) is left out: check() takes step results.
# Nothing here says which claims are right: check() finds that by computing.
ARTICLE_CLAIMS: dict[str, Any] = {
    **ARTICLE,
    "Q": [["0.14", "0.69"], ["-0.38", "0.07"], ["0.25", "-0.43"]],
    "K": [["-0.24", "0.33"], ["0.12", "-0.45"], ["0.29", "0.67"]],
    "V": [["0.21", "0.02"], ["0.16", "0.31"], ["-0.25", "0.38"]],
    "scores[0]": ["0.194", "-0.294", "0.503"],
    "scaled_scores[0]": ["0.137", "-0.208", "0.356"],
    "exp_scores[0]": ["1.147", "0.812", "1.427"],
    "weights[0]": ["0.339", "0.240", "0.421"],
    "output[0]": ["0.004", "0.241"],
    "softmax": [
        {
            "scores": [2.0, -1.0, 0.5],
            "weights": ["0.70", "0.04", "0.26"],
            "values": [[0.1, 0.2], [0.3, -0.1], [-0.2, 0.4]],
            "output": ["0.03", "0.24"],
        }
    ],
}
