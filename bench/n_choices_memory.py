"""n > 1 choices of one prompt: the decode KV blocks they hold at most, the prompt tokens the
prefill computed, and the wall time; beside the same n choices sent as n requests of one choice
at once (each its own prefill, KV hand-off and copy of the prompt's KV: how baton served n before
the choices shared the prompt's KV). Against a running `baton local --http-listen
127.0.0.1:18080 --metrics-listen 127.0.0.1:19090` on SmolLM2:

    python bench/n_choices_memory.py 1,4,8 SEED

Each measurement gets a fresh 1,000-word prompt (no cached prefix from an earlier one),
completions with max_tokens 48, temperature 1; a thread polls baton_kv_blocks_free{role="decode"}
every 20 ms for the low point; the prefix cache counters give the prompt tokens computed vs reused."""
import random, sys, threading, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
import openai
M = "http://127.0.0.1:19090/metrics"
def metrics():
    return urllib.request.urlopen(M, timeout=5).read().decode()
def val(text, name, role):
    for line in text.splitlines():
        if line.startswith(name + "{") and f'role="{role}"' in line:
            return float(line.rsplit(" ", 1)[1])
def counter(text, name):
    return sum(float(l.rsplit(" ",1)[1]) for l in text.splitlines() if l.startswith(name + "{"))
c = openai.OpenAI(base_url="http://127.0.0.1:18080/v1", api_key="x")
rng = random.Random(int(sys.argv[2]))
words = ["river","engine","violet","seven","garden","orbit","copper","lantern","north","maple","quiet","harbor"]
kw = dict(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=48, temperature=1)
def one_request(prompt, n):
    r = c.completions.create(prompt=prompt, n=n, seed=1, **kw)
    return r.usage.prompt_tokens
def n_requests(prompt, n):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda j: c.completions.create(prompt=prompt, seed=j, **kw).usage.prompt_tokens,
                             range(n)))[0]
def measure(n, how):
    prompt = " ".join(rng.choice(words) for _ in range(1000))  # fresh words each time: no cached prefix
    m0 = metrics(); total = val(m0, "baton_kv_blocks_capacity", "decode"); free0 = val(m0, "baton_kv_blocks_free", "decode")
    look0, hit0 = counter(m0, "baton_prefix_cache_lookup_tokens_total"), counter(m0, "baton_prefix_cache_hit_tokens_total")
    low = [free0]; done = threading.Event()
    def poll():
        while not done.is_set():
            low[0] = min(low[0], val(metrics(), "baton_kv_blocks_free", "decode")); time.sleep(0.02)
    t = threading.Thread(target=poll); t.start()
    start = time.monotonic()
    prompt_tokens = how(prompt, n)
    wall = time.monotonic() - start
    done.set(); t.join()
    m1 = metrics()
    look, hit = counter(m1, "baton_prefix_cache_lookup_tokens_total") - look0, counter(m1, "baton_prefix_cache_hit_tokens_total") - hit0
    label = "one request, n choices" if how is one_request else "n requests at once"
    print(f"n={n} ({label}): prompt {prompt_tokens} tokens, decode KV blocks in use at most {free0 - low[0]:.0f} of "
          f"{total:.0f}; prefill computed {look - hit:.0f} prompt tokens ({hit:.0f} from the prefix cache); {wall:.2f} s")
for n in [int(x) for x in sys.argv[1].split(",")]:
    measure(n, one_request)
    if n > 1:
        measure(n, n_requests)
