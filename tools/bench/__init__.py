"""`tandem bench`: Tandem against its anchors, side by side in one run, with plots.

  prompts.jsonl  the fixed prompt set (chat, story, code rewriting, summarisation, lists)
  baselines.py   transformers generate / assisted generation / prompt lookup, in process
  client.py      the gateway (streaming, concurrency) and the verifier's gRPC (round stats)
  sse.py         the gateway's streamed chat completions read as chunks (benchmarks/ too)
  config.py      BenchConfig, the methods each phase runs, the prompts, draft and EAGLE head
  runner.py      one run: peers, then a local cluster; a JSON-able dict
  phases.py      the run's phases: peers, gateway, verifier rounds, concurrency
  host.py        the machine's description, memory release, cluster logs off the bar
  stats.py       percentiles, acceptance, Leviathan's bound, round breakdown (pure Python)
  summary.py     raw results -> tables and targets (pure Python)
  shapes.py      the chain-vs-tree phase (eagle, medusa) and its table, bound and section
  report.py      results.json, Markdown report, docs/results/benchmarks.md; plots.py the PNGs,
                 mdtable.py the Markdown cells
  cli.py         `register(subparsers)` and `python -m tools.bench.cli`
  copy_heavy.py  `--workload copy`: a cluster per drafting place, every prompt and arm;
                 copy_prompts.py its prompts by category, copy_report.py its arithmetic,
                 table and docs/results/benchmarks-copy.md
"""
