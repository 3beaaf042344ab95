import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["kind"] == "train":
        rows[(r["rate"], r["model"], r["mode"])] = r
print("| link | model | exact comm (ms) | bf16 pipelined comm (ms) | bf16 whole-bucket comm (ms) | pipelined / whole | wire MB/step (pipelined, whole) |")
print("|---|---|---|---|---|---|---|")
for rate in ("1gbit", "10gbit"):
    for model in ("mlp", "wide"):
        local = rows[(rate, model, "local")]["median_ms"]
        comm = {m: rows[(rate, model, m)]["median_ms"] - local for m in ("exact", "bf16", "bf16old")}
        print(f"| {rate} | {model} | {comm['exact']:.1f} | {comm['bf16']:.1f} | {comm['bf16old']:.1f} | "
              f"{comm['bf16'] / comm['bf16old']:.2f} | {rows[(rate, model, 'bf16')]['wire_mb']:.1f}, "
              f"{rows[(rate, model, 'bf16old')]['wire_mb']:.1f} |")
