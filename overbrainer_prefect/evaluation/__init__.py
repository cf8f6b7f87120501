"""Evaluation of a fine-tune: did it help, what did it break (core: no Prefect).

- `spec`: what an evaluation asks (held-out rows, an eval file, controls,
  scorers, an optional judge) and the plan that repeats it exactly;
- `items`: eval files, the shipped controls and held-out rows as items;
- `scorers`: exact, contains, regex and numeric scoring of an answer;
- `stats`: the Wilson interval and McNemar's exact test;
- `judge`: the pairwise base-vs-tuned LLM judge;
- `results`: the scored result of an evaluation job;
- `verdict`: its one-line verdict and markdown;
- `gate`: the rule a nightly fine-tune must pass to be delivered.
"""
