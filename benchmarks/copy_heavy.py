"""Copy-heavy prompts through the gateway (tools/bench/copy_heavy.py; also `tandem bench
--workload copy`): plain decoding against ngram, suffix and auto, drafted in the verifier or by
a draft worker. `--help` for the options."""
from tools.bench.copy_heavy import main

if __name__ == "__main__":
    main()
