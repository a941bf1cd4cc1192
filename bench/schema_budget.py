#!/usr/bin/env python3
"""Measures what real JSON schemas cost structured output, to set the schema budget
(grammar/json_schema.h SchemaBudget, common/json_bounds.h) at about 10x the largest.

    bench/schema_budget.py [--model GGUF] [--out DIR] SCHEMA_FILE_OR_DIR...

Each schema is also rewritten to the subset baton compiles (so that config-file schemas, which use
keywords structured output does not have, are measured for the size of what they describe):
keywords outside the subset are dropped, oneOf is read as anyOf, an allOf of one schema is merged
into its parent (of more, the first is), a tuple `items` keeps its first schema, a $ref outside
the document is any value, counted limits over 1024 are dropped, `required` keeps only declared
properties. Both the original (where it compiles as it is) and the rewritten form are measured by
build/bench/baton_bench_schema; its table goes to stdout. bench/RESULTS.md "Schema budget" has a
run over 430 public schemas (JSONSchemaBench's real-world sets, SchemaStore, BFCL function
definitions, MCP tool schemas); the schemas themselves are not kept in the repository.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

SUBSET = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength",
          "maxLength", "enum", "const", "anyOf", "$ref", "$defs", "definitions"}
COUNTED = {"minItems", "maxItems", "minLength", "maxLength"}
TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def to_subset(s, depth=0):
    if isinstance(s, bool):
        return s
    if not isinstance(s, dict) or depth > 200:
        return {}
    s = dict(s)
    if "oneOf" in s and "anyOf" not in s:
        s["anyOf"] = s.pop("oneOf")
    if isinstance(s.get("allOf"), list) and s["allOf"]:
        first = s["allOf"][0]
        if isinstance(first, dict):
            for k, v in first.items():
                s.setdefault(k, v)
    out = {}
    for k, v in s.items():
        if k not in SUBSET:
            continue
        if k in ("properties", "$defs", "definitions"):
            if isinstance(v, dict):
                out[k] = {name: to_subset(sub, depth + 1) for name, sub in v.items()}
        elif k == "items":
            if isinstance(v, list):
                if v:
                    out[k] = to_subset(v[0], depth + 1)
            else:
                out[k] = to_subset(v, depth + 1)
        elif k == "additionalProperties":
            if isinstance(v, (bool, dict)):
                out[k] = to_subset(v, depth + 1)
        elif k == "anyOf":
            if isinstance(v, list) and v:
                out[k] = [to_subset(x, depth + 1) for x in v]
        elif k in COUNTED:
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1024:
                out[k] = v
        elif k == "type":
            if isinstance(v, str) and v in TYPES:
                out[k] = v
            elif isinstance(v, list) and v and all(isinstance(t, str) and t in TYPES for t in v):
                out[k] = v
        elif k == "enum":
            if isinstance(v, list) and v:
                out[k] = v
        elif k == "$ref":
            if isinstance(v, str) and v.startswith("#"):
                out[k] = v
        else:
            out[k] = v
    # What only one keyword may stand beside: $ref and anyOf alone; const and enum win over type.
    if "$ref" in out:
        out = {k: v for k, v in out.items() if k in ("$ref", "$defs", "definitions")}
    elif "anyOf" in out:
        out = {k: v for k, v in out.items() if k in ("anyOf", "$defs", "definitions")}
    if "properties" in out and "required" in out:
        if isinstance(out["required"], list):
            out["required"] = [r for r in out["required"] if isinstance(r, str) and r in out["properties"]]
        else:
            del out["required"]
    elif "required" in out:
        del out["required"]
    for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if lo in out and hi in out and out[hi] < out[lo]:
            del out[hi]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--model", default="")
    ap.add_argument("--bench", default=os.path.join(os.path.dirname(__file__), "..", "build", "bench",
                                                     "baton_bench_schema"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    files = []
    for p in a.paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".json") and not f.startswith("."))
        else:
            files.append(p)
    out = a.out or tempfile.mkdtemp(prefix="schema-subset-")
    os.makedirs(out, exist_ok=True)
    rewritten = []
    for f in files:
        try:
            with open(f) as fh:
                s = json.load(fh)
        except (OSError, ValueError):
            continue
        target = os.path.join(out, "subset__" + os.path.basename(f))
        with open(target, "w") as fh:
            json.dump(to_subset(s), fh)
        rewritten.append(target)
    cmd = [a.bench] + (["--model", a.model] if a.model else [])
    for label, batch in (("as they are", files), ("rewritten to the subset", rewritten)):
        print(f"\n### {len(batch)} schemas {label}\n", flush=True)
        subprocess.run(cmd + batch, check=True, stdout=sys.stdout)


if __name__ == "__main__":
    main()
