"""MLA's absorbed query in one kernel after ``q_b``'s launch: ``[q_nope W_UK | RoPE(q_pe)]`` per head."""
