#!/usr/bin/env bash
# The third-party clients the tests run against `tandem serve` (tests/test_third_party_clients.py):
# litellm and the guidellm load generator, in their own virtual environment (.clients),
# because their pins (openai 2.x, huggingface_hub 1.x) differ from the project's.
# torch comes first so that guidellm's bare `torch` requirement takes the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .clients
.clients/bin/pip install -q torch==2.13.0
.clients/bin/pip install -q litellm==1.106.2 guidellm==0.8.1 mcp==2.3.0  # litellm imports mcp
