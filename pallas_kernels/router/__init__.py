"""MoE router expert selection (sigmoid scores, biased group-limited top-k, weights) after the logits."""
