#!/usr/bin/env bash
# Open WebUI end to end against `specexec serve`, driven by headless Chromium (a manual check:
# not run by the tests or CI; Open WebUI and playwright are not project dependencies).
#
# One-time setup (about 7.5 GB and 10 minutes; any venv outside the repo):
#   python3 -m venv ~/owui && ~/owui/bin/pip install open-webui playwright
#   apt-get install chromium          # or set CHROMIUM=/path/to/chrome; no `playwright install` needed
# Run:
#   OWUI_VENV=~/owui bash scripts/open-webui-check.sh [extra `specexec serve` flags]
#   OWUI_CONNECTION=ollama OWUI_VENV=~/owui bash scripts/open-webui-check.sh   # Open WebUI's Ollama connection (/api/*)
#
# Starts `specexec serve` (built-in pair unless flags say otherwise), a logging pass-through
# (scripts/open_webui_proxy.py: one JSON line per completion request Open WebUI sends), and
# Open WebUI offline with a fresh data folder and default chat settings; then the driver
# (scripts/open_webui_driver.py) picks the model, sends a message and waits for the streamed
# reply. Everything lands in $CHECK_OUT: screenshot, requests.jsonl, the three logs, /metrics.
# Open WebUI's follow-up / tags requests run after the reply (the stop button stays up); the
# driver waits for them. Every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

OWUI_VENV=${OWUI_VENV:-$HOME/owui}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
CHECK_OUT=${CHECK_OUT:-/tmp/open-webui-check}
SPECEXEC_PORT=${SPECEXEC_PORT:-8000}
PROXY_PORT=${PROXY_PORT:-8001}
OWUI_PORT=${OWUI_PORT:-8080}
OWUI_CONNECTION=${OWUI_CONNECTION:-openai}  # openai: /v1 (OpenAI API connection); ollama: /api/* (Ollama API connection)
if [ "$OWUI_CONNECTION" = ollama ]; then
  MODEL=${MODEL:-specexec-default:latest}  # Ollama names carry a tag
  CONNECTION_ENV=(ENABLE_OLLAMA_API=True ENABLE_OPENAI_API=False)
else
  MODEL=${MODEL:-specexec-default}
  CONNECTION_ENV=(ENABLE_OLLAMA_API=False)
fi
MESSAGE=${MESSAGE:-Write a Python function that reads a file.}
REPLY_TIMEOUT=${REPLY_TIMEOUT:-300}  # seconds for the streamed reply
TASKS_TIMEOUT=${TASKS_TIMEOUT:-300}  # seconds for the background requests after it

[ -x "$OWUI_VENV/bin/open-webui" ] || { echo "no Open WebUI in $OWUI_VENV (see the header of $0)" >&2; exit 2; }
"$OWUI_VENV/bin/python" -c "import playwright" 2>/dev/null \
  || { echo "playwright missing: $OWUI_VENV/bin/pip install playwright" >&2; exit 2; }
[ -x "$CHROMIUM" ] || { echo "no Chromium at $CHROMIUM (apt-get install chromium, or set CHROMIUM)" >&2; exit 2; }
[ -x .venv/bin/specexec ] || source scripts/setup.sh

mkdir -p "$CHECK_OUT"
CHECK_OUT=$(cd "$CHECK_OUT" && pwd)
rm -f "$CHECK_OUT"/requests.jsonl
DATA_DIR=$(mktemp -d)  # a fresh Open WebUI database: default settings, no users (WEBUI_AUTH=False)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$DATA_DIR"
}
trap cleanup EXIT

wait_http() {  # url seconds
  for _ in $(seq "$2"); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done
  echo "$1 not up after $2 s" >&2; return 1
}

.venv/bin/specexec serve --port "$SPECEXEC_PORT" "$@" > "$CHECK_OUT/specexec.log" 2>&1 &
PIDS+=($!)
.venv/bin/python scripts/open_webui_proxy.py --listen "$PROXY_PORT" --upstream "http://127.0.0.1:$SPECEXEC_PORT" \
  --log "$CHECK_OUT/requests.jsonl" > "$CHECK_OUT/proxy.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$SPECEXEC_PORT/health" 300

# Offline: no Ollama, no model downloads (embeddings, whisper), no update checks. Run from
# $DATA_DIR: Open WebUI writes .webui_secret_key into its working folder.
OWUI_BIN="$(cd "$OWUI_VENV" && pwd)/bin/open-webui"
(cd "$DATA_DIR" && exec env DATA_DIR="$DATA_DIR" WEBUI_AUTH=False OFFLINE_MODE=True HF_HUB_OFFLINE=1 "${CONNECTION_ENV[@]}" \
    OPENAI_API_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" OPENAI_API_KEY=none OLLAMA_BASE_URL="http://127.0.0.1:$PROXY_PORT" \
    ENABLE_VERSION_UPDATE_CHECK=False ANONYMIZED_TELEMETRY=False DO_NOT_TRACK=True SCARF_NO_ANALYTICS=True \
    "$OWUI_BIN" serve --host 127.0.0.1 --port "$OWUI_PORT") > "$CHECK_OUT/open-webui.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$OWUI_PORT/health" 600

status=0
"$OWUI_VENV/bin/python" scripts/open_webui_driver.py --url "http://127.0.0.1:$OWUI_PORT" --model "$MODEL" \
  --message "$MESSAGE" --screenshot "$CHECK_OUT/open-webui-$OWUI_CONNECTION.png" --chromium "$CHROMIUM" \
  --timeout "$REPLY_TIMEOUT" --tasks-timeout "$TASKS_TIMEOUT" || status=$?
sleep 2  # the last request's log line
curl -s "http://127.0.0.1:$SPECEXEC_PORT/metrics" > "$CHECK_OUT/metrics.txt" || true
echo "requests Open WebUI sent to specexec (start, kind, status, seconds, tokens):"
.venv/bin/python - "$CHECK_OUT/requests.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]) if __import__("os").path.exists(sys.argv[1]) else []:
    r = json.loads(line)
    usage, timings = r.get("usage") or {}, r.get("timings") or {}
    print(f"  {r.get('started')} {r['kind']:<11} {r.get('status')} stream={r['stream']!s:<5} tools={r['tools']:<3} "
          f"total={r.get('total_s')} s prompt={usage.get('prompt_tokens')} completion={usage.get('completion_tokens')} "
          f"passes={timings.get('target_passes')} finish={r.get('finish_reason')} {r.get('error', '')}")
EOF
echo "screenshot: $CHECK_OUT/open-webui-$OWUI_CONNECTION.png"
exit "$status"
