"""Lightning-indexer logits: sum_h w[t,h] * relu(q[t,h] . k[s]) with a causal limit."""
