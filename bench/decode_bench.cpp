// bench/decode: batched decode steps on the CPU backend, as a decode worker runs them. For each
// batch size B it prefills B sequences of C random prompt tokens, then times decode steps (one
// token per sequence, greedy sampling in the step, the KV growing by one position each) and
// reports ms per step and output tokens/s. BATON_PROFILE=1 adds the per-op breakdown of the last
// batch size's decode steps at exit. --logprobs K asks each step for every sequence's
// log-probabilities with K alternatives; --penalties sets presence, frequency and repetition
// penalties over each sequence's prompt and output (what a penalised request costs a step).
// --json-schema FILE (or "object": any JSON object) constrains every sequence's output to the
// schema (structured output: the grammar's masks computed as decode steps need them, the first
// token included); the mean step shows first-use masks, the sampler column the host's share
// (specs and masks gathered, tokens observed), the last the masks computed. Output is a Markdown table (bench/RESULTS.md keeps the measured ones).
//
//   baton_bench_decode MODEL.gguf [--batch B]... [--context C] [--steps N] [--kv-dtype f32|bf16]
//                      [--weights native|dense|native-only] [--threads T] [--logprobs K] [--penalties 1]
//                      [--json-schema FILE|object]
#include <algorithm>
#include <fstream>
#include <memory>
#include <sstream>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kv/block_pool.h"
#include "model/model.h"
#include "model/model_files.h"
#include "model/output_constraints.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

using namespace baton;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s MODEL.gguf [--batch B]... [--context C] [--steps N] [--kv-dtype f32|bf16] "
               "[--weights native|dense|native-only] [--threads T] [--logprobs K] [--penalties 1] [--json-schema FILE|object]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage(argv[0]);
  std::vector<int> batches;
  int context = 256, steps = 64, threads = 0, logprobs = -1;
  bool penalties = false;
  std::string json_schema;
  DType kv_dtype = DType::kF32;
  Model::Weights weights = Model::Weights::kNativeAndDense;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string val = argv[++i];
    if (arg == "--batch") {
      batches.push_back(std::stoi(val));
    } else if (arg == "--context") {
      context = std::stoi(val);
    } else if (arg == "--steps") {
      steps = std::stoi(val);
    } else if (arg == "--threads") {
      threads = std::stoi(val);
    } else if (arg == "--logprobs") {
      logprobs = std::stoi(val);
    } else if (arg == "--penalties") {
      penalties = val != "0";
    } else if (arg == "--json-schema") {
      json_schema = val;
    } else if (arg == "--kv-dtype" && (val == "f32" || val == "bf16")) {
      kv_dtype = val == "f32" ? DType::kF32 : DType::kBF16;
    } else if (arg == "--weights" && (val == "native" || val == "dense" || val == "native-only")) {
      weights = val == "native" ? Model::Weights::kNativeAndDense
                : val == "dense" ? Model::Weights::kDense
                                 : Model::Weights::kNative;
    } else {
      return usage(argv[0]);
    }
  }
  if (batches.empty()) batches = {1, 8};
  if (context < 1 || steps < 1) return usage(argv[0]);
  auto files = open_model_files(argv[1]);  // a GGUF file or a Hugging Face directory
  if (!files.ok()) {
    std::fprintf(stderr, "baton: error: %s\n", files.status().message().c_str());
    return 1;
  }
  std::string err;
  auto be = make_backend({"cpu", DType::kBF16, threads, {}}, &err);
  if (!be) {
    std::fprintf(stderr, "baton: error: %s\n", err.c_str());
    return 1;
  }
  // Native weights come with dense ones, as in baton generate: the set-up prefills run on dense
  // weights (fast), every decode step (M <= Backend::kNativeMaxRows) on the native ones.
  // native-only holds the native ones alone (a model whose dense copy would not fit: the set-up
  // prefills run on them too).
  auto model = Model::load(*files->source, *be, {}, weights);
  if (!model.ok()) {
    std::fprintf(stderr, "baton: error: %s\n", model.status().message().c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config();
  constexpr int kBlock = 16;
  SamplingParams sp;
  sp.top_logprobs = logprobs;
  if (penalties) {
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.5f;
    sp.repetition_penalty = 1.2f;
  }
  std::shared_ptr<OutputConstraints> constraints;
  if (!json_schema.empty()) {
    if (json_schema == "object") {
      sp.format.kind = OutputFormat::Kind::kJsonObject;
    } else {
      std::ifstream in(json_schema);
      std::stringstream text;
      text << in.rdbuf();
      if (!in) {
        std::fprintf(stderr, "baton: error: cannot read %s\n", json_schema.c_str());
        return 1;
      }
      sp.format = {OutputFormat::Kind::kJsonSchema, text.str()};
    }
    const double t0 = now();
    constraints = std::make_shared<OutputConstraints>(*files->tokenizer, c.n_vocab);
    if (const Status st = constraints->resolve(&sp); !st.ok()) {
      std::fprintf(stderr, "baton: error: %s\n", st.message().c_str());
      return 1;
    }
    const double t1 = now();
    sp.constraint->mask(sp.constraint->start());
    std::fprintf(stderr, "vocabulary trie and schema: %.1f ms; the first mask: %.1f ms\n", (t1 - t0) * 1e3,
                 (now() - t1) * 1e3);
  }
  char sampling[96];
  std::snprintf(sampling, sizeof sampling, "greedy%s%s%s", penalties ? ", penalties" : "",
                logprobs >= 0 ? (", logprobs " + std::to_string(logprobs)).c_str() : "",
                sp.constraint ? (", " + (json_schema == "object" ? std::string("json_object") : "json_schema")).c_str() : "");
  std::printf("| batch | context | KV | weights | sampling | ms per step | output tok/s | mean ms per step | "
              "sampler ms per step | masks |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (int b : batches) {
    const int blocks_per_seq = (context + steps + kBlock) / kBlock + 1;
    BlockPool pool(b * blocks_per_seq, kBlock);
    auto cache = (*model)->make_kv_cache(pool.n_total(), kBlock, kv_dtype);
    std::mt19937 rng(static_cast<unsigned>(b * 7919 + context));
    std::vector<std::vector<int32_t>> tables(static_cast<size_t>(b));
    std::vector<int32_t> last(static_cast<size_t>(b));
    std::vector<int32_t> tokens;
    std::vector<TokenLogprobs> token_logprobs;
    std::vector<Sampler> samplers(static_cast<size_t>(b), Sampler(sp));
    const SampleSpec greedy;
    for (int s = 0; s < b; ++s) {  // one prefill per sequence, as prefill workers hand them over
      std::vector<int32_t> prompt(static_cast<size_t>(context));
      for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % c.n_vocab);
      pool.grow_to(tables[s], context);
      StepBatch batch;
      batch.add(prompt, 0, tables[s], Logits::kLast);
      samplers[s].set_history(prompt, {});
      const SampleSpec first = sp.constraint ? samplers[s].spec_at(context) : greedy;
      (*model)->forward_sample(batch, *cache, std::span(&first, 1), {}, &tokens, nullptr);
      last[s] = tokens[0];
      samplers[s].set_history(prompt, std::span(&last[s], 1));
    }
    reset_op_profile();  // BATON_PROFILE: the decode steps only (the last batch size's)
    std::vector<SampleSpec> specs(static_cast<size_t>(b));
    std::vector<LogitAdjust> adjust;
    std::vector<double> times;
    double sampler_seconds = 0.0;  // the host's share: specs and masks before the step, observing after
    for (int step = 0; step < steps; ++step) {
      const int32_t pos = context + step;
      StepBatch batch;
      for (int s = 0; s < b; ++s) {
        pool.grow_to(tables[s], pos + 1);
        batch.add(std::span(&last[s], 1), pos, tables[s], Logits::kLast);
      }
      // The step as a decode worker takes it: its sequences' specs and penalties gathered, sampled.
      const double t0 = now();
      adjust.clear();
      for (int s = 0; s < b; ++s) {
        samplers[s].adjustments(s, &adjust);
        specs[s] = samplers[s].spec_at(pos + 1);
      }
      const double t1 = now();
      (*model)->forward_sample(batch, *cache, specs, adjust, &tokens, &token_logprobs);
      const double t2 = now();
      for (int s = 0; s < b; ++s) samplers[s].observe(tokens[s]);
      const double t3 = now();
      times.push_back(t3 - t0);
      sampler_seconds += (t1 - t0) + (t3 - t2);
      for (int s = 0; s < b; ++s) last[s] = tokens[s];
    }
    double mean = 0.0;
    for (double t : times) mean += t / static_cast<double>(times.size());
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf("| %d | %d–%d | %s | %s | %s | %.2f | %.1f | %.2f | %.3f | %s |\n", b, context, context + steps,
                dtype_name(kv_dtype), weights == Model::Weights::kDense ? "dense" : "native", sampling, median * 1e3,
                b / median, mean * 1e3, sampler_seconds / steps * 1e3,
                sp.constraint ? std::to_string(sp.constraint->n_masks()).c_str() : "–");
    std::fflush(stdout);
  }
  return 0;
}
