#!/usr/bin/env bash
# npm run lint: Biome (TS/JS lint + format check) and clang-format (C++).
set -euo pipefail
cd "$(dirname "$0")/.."
npx biome check .
mapfile -t cpp < <(git ls-files 'native/*.h' 'native/*.cpp' 'test/fuzz/*.cpp')
clang-format --dry-run --Werror "${cpp[@]}"
echo "lint: ${#cpp[@]} C++ files formatted, TS/JS clean"
