#!/usr/bin/env sh
# A streaming chat completion with curl.
#   TOKENWAY_URL=http://127.0.0.1:8000/v1 sh examples/curl.sh
curl -sN "${TOKENWAY_URL:-http://127.0.0.1:8000/v1}/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "deepseek-v4", "stream": true, "max_tokens": 20,
       "messages": [{"role": "user", "content": "Hello!"}]}'
