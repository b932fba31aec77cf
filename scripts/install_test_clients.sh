#!/usr/bin/env bash
# The third-party clients the tests run against `tandem serve` (tests/test_third_party_clients.py):
# litellm, the guidellm load generator and LangChain's ChatOpenAI, in their own virtual
# environment (.clients), because their pins (openai 2.x, huggingface_hub 1.x) differ from the project's.
# torch comes first so that guidellm's bare `torch` requirement takes the CPU build.
# Every version is held to constraints/clients.txt; CLIENTS_CONSTRAINTS= (empty) resolves
# afresh and CLIENTS_VENV puts the environment elsewhere (scripts/readme_commands.py
# refresh-pins uses both).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${CLIENTS_VENV:-.clients}"
constraints="${CLIENTS_CONSTRAINTS-constraints/clients.txt}"
pin=()
if [[ -n "$constraints" ]]; then pin=(-c "$constraints"); fi
python -m venv "$venv"
"$venv/bin/pip" install -q "${pin[@]}" torch==2.13.0
"$venv/bin/pip" install -q "${pin[@]}" litellm==1.106.2 guidellm==0.8.1 mcp==2.3.0 \
    langchain-openai==1.8.1  # litellm imports mcp
