# Two entry points (see README): `make run` and `make test`. Both create their own virtualenv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test audit venv stubs bench lint clean

$(BIN)/tandem: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# checkov (the deploy tier's standard policies, tests/deploy/test_policies.py) in a virtualenv
# of its own: its pins would downgrade packaging, networkx and cyclonedx in $(VENV).
CHECKOV_VERSION ?= 3.3.30
$(VENV)/checkov/bin/checkov: | $(BIN)/tandem
	$(PY) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install -q 'checkov==$(CHECKOV_VERSION)'

venv: $(BIN)/tandem $(VENV)/checkov/bin/checkov

run: venv
	$(BIN)/tandem models fetch
	$(BIN)/tandem up --demo "Write a short poem about speculative decoding."

test: venv
	$(BIN)/tandem models fetch
	$(BIN)/python -m pytest -q

# Known vulnerabilities in the installed dependencies (pip-audit); fails on findings only,
# not when the vulnerability service is unreachable (.ci/audit.py says which happened).
audit: venv
	$(BIN)/python .ci/audit.py

stubs: venv
	$(BIN)/python -m tools.protogen

bench: venv
	$(BIN)/tandem models fetch
	$(BIN)/python benchmarks/runner_speed.py
	$(BIN)/tandem bench --quick

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
