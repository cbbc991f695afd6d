"""What the chapters show and run: one views module per chapter (op_counts, expert_sweep,
backends, fp8_training, step_tables, layouts, analyze_tables, run_history), the live dashboard
and widgets, lesson helpers, probes, checks, and the notebook runner and report."""
