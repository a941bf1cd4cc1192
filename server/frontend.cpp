#include "server/frontend.h"

#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "common/grpc_status.h"
#include "common/thread_name.h"
#include "proto/convert.h"

namespace baton {

namespace {

// libprotobuf logs a line at ERROR for every string field with invalid UTF-8 it refuses to parse:
// a client could flood the log. The client gets INVALID_ARGUMENT (generate_call.cpp); the line
// goes to debug. Anything FATAL stays loud.
void protobuf_log(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf {}:{}: {}", file, line, message);
  } else {
    spdlog::debug("protobuf {}:{}: {}", file, line, message);
  }
}

}  // namespace

Result<std::unique_ptr<Frontend>> Frontend::create(FrontendConfig config, Metrics* metrics) {
  google::protobuf::SetLogHandler(&protobuf_log);
  auto fe = std::unique_ptr<Frontend>(new Frontend(metrics));
  BATON_ASSIGN_OR_RETURN(fe->files_, open_model_files(config.model_path));
  fe->model_.config = fe->files_.source->config();
  fe->model_.fingerprint = fe->files_.source->fingerprint();
  fe->model_.tokenizer = fe->files_.tokenizer.get();
  fe->model_.name = fe->files_.name();
  fe->model_.max_priority = config.max_priority;
  fe->local_prefill_max_tokens_ = config.scheduler.local_prefill_max_tokens;
  fe->model_.max_prompt_bytes = max_prompt_bytes(*fe->files_.tokenizer, fe->model_.config.n_ctx);
  // A template baton cannot render stops the start (--chat-template is the way on); a model
  // without any template serves prompts, and chat requests are refused with the reason.
  Result<ChatTemplate> tmpl = fe->files_.chat_template_for(config.chat_template);
  if (tmpl.ok()) {
    fe->model_.chat_template = *tmpl;
    spdlog::info("chat template: {}", tmpl->name());
  } else if (tmpl.status().code() == StatusCode::kNotFound && config.chat_template.empty()) {
    spdlog::warn("chat requests are disabled: {}", tmpl.status().message());
  } else {
    return tmpl.status();
  }
  BATON_RETURN_IF_ERROR(config.registry.validate());
  BATON_RETURN_IF_ERROR(config.scheduler.validate());
  config.workers.model_fingerprint = fe->model_.fingerprint;
  BATON_RETURN_IF_ERROR(config.workers.validate());
  fe->registry_ = std::make_unique<WorkerRegistry>(config.registry, fe->clock_);
  fe->scheduler_ = std::make_unique<Scheduler>(config.scheduler, *fe->registry_, fe->clock_);
  if (metrics != nullptr) {
    const auto labels = Metrics::role_labels("frontend", config.name);
    SchedulerEvents events;
    events.ttft = [metrics, labels](double predicted, double actual) {
      metrics->histogram(metrics->ttft_predicted_seconds, labels).Observe(predicted);
      if (actual > 0) {
        metrics->histogram(metrics->ttft_prediction_error_ratio, labels).Observe(std::abs(predicted - actual) / actual);
      }
    };
    events.slo_rejected = [metrics](SloRejection reason) {
      metrics->slo_rejections_total.Add({{"reason", slo_rejection_name(reason)}}).Increment();
    };
    // Both reasons from the start, at 0: a rate() over them is 0, not "no data", before the first.
    for (SloRejection r : {SloRejection::kPrefillQueue, SloRejection::kDecodeKv}) {
      metrics->slo_rejections_total.Add({{"reason", slo_rejection_name(r)}});
    }
    fe->scheduler_->set_events(std::move(events));
  }
  Frontend* raw = fe.get();
  if (config.pipeline.max_failovers < 0) return invalid_argument("max_failovers must be >= 0");
  BATON_RETURN_IF_ERROR(config.pipeline.progress.validate());
  if (config.max_request.count() <= 0) return invalid_argument("--max-request-seconds must be positive");
  fe->pool_ = std::make_unique<WorkerPool>(config.workers, *fe->registry_, [raw] { raw->on_poll(); });
  fe->client_ = std::make_unique<GrpcWorkerClient>(*fe->pool_);
  fe->context_.model = &fe->model_;
  fe->context_.pipeline.scheduler = fe->scheduler_.get();
  fe->context_.pipeline.registry = fe->registry_.get();
  fe->context_.pipeline.client = fe->client_.get();
  fe->context_.pipeline.clock = &fe->clock_;
  fe->context_.pipeline.config = config.pipeline;
  fe->context_.pipeline.watch = &fe->watch_;
  fe->context_.max_request = config.max_request;
  fe->context_.metrics = metrics;
  fe->context_.name = config.name;
  fe->context_.live_calls = &fe->live_calls_;
  fe->context_.draining = &fe->draining_;
  fe->api_keys_ = config.api_keys;
  fe->context_.api_keys = fe->api_keys_.get();
  if (metrics != nullptr) {
    // Create the request-level series at start-up (at zero), so that rate() over them counts the
    // first requests after a start too.
    const auto labels = Metrics::role_labels("frontend", config.name);
    for (auto* h : {&metrics->ttft_seconds, &metrics->queue_seconds, &metrics->e2e_seconds, &metrics->tpot_seconds}) {
      metrics->histogram(*h, labels);
    }
    metrics->requests_total.Add({{"code", "OK"}});
    for (const char* reason : {"prefill", "kv_handoff", "decode_admit", "decode"}) {
      metrics->request_failovers_total.Add({{"reason", reason}});
    }
    metrics->prompt_tokens_total.Add({});
    metrics->generation_tokens_total.Add({});
  }
  return fe;
}

Frontend::~Frontend() { stop(); }

void Frontend::start() {
  pool_->poll_now();
  pool_->start();
  if (!context_.pipeline.config.progress.enabled) return;
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (!watch_thread_.joinable()) watch_thread_ = std::thread([this] { watch_loop(); });
}

void Frontend::watch_loop() {
  set_thread_name("progress-watch");
  // A tenth of the grace, within [10 ms, 100 ms]: a stuck attempt is seen within 10 % past its bound.
  const auto tick = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(
      std::clamp(context_.pipeline.config.progress.grace_seconds / 10, 0.01, 0.1)));
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_cv_.wait_for(lock, tick, [this] { return watch_stopping_; })) {
    lock.unlock();
    watch_.check(clock_.now());
    lock.lock();
  }
}

void Frontend::stop() {
  // Requests first, then the worker calls they leave behind (cancelled ones end quickly).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto busy = [this] { return live_calls_.load() > 0 || (client_ && client_->n_in_flight() > 0); };
  while (busy() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (busy()) {
    spdlog::warn("{} requests and {} worker calls still hold the frontend at shutdown", live_calls_.load(),
                 client_ ? client_->n_in_flight() : 0);
  }
  if (pool_) pool_->stop();
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();
}

void Frontend::set_draining() {
  std::lock_guard<std::mutex> lock(health_mu_);
  draining_ = true;
  update_health_locked();
}

void Frontend::set_health_reporter(std::function<void(bool)> report) {
  std::lock_guard<std::mutex> lock(health_mu_);
  health_reporter_ = std::move(report);
  serving_.reset();
  update_health_locked();
}

void Frontend::on_poll() {
  scheduler_->poll();
  update_gauges();
  std::lock_guard<std::mutex> lock(health_mu_);
  update_health_locked();
}

void Frontend::update_health_locked() {
  const auto decode_workers = registry_->snapshot(WorkerRole::kDecode);
  // A decode worker that prefills prompts itself serves without a prefill worker (colocated).
  const bool local = local_prefill_max_tokens_ > 0 &&
                     std::any_of(decode_workers.begin(), decode_workers.end(), [](const WorkerSnapshot& w) {
                       return w.can_place() && w.load.local_prefill_max_tokens > 0;
                     });
  const bool prefill = local || any_placeable(registry_->snapshot(WorkerRole::kPrefill));
  const bool decode = any_placeable(decode_workers);
  const bool serving = !draining_ && prefill && decode;
  if (serving_ == serving) return;
  if (serving_.has_value() || !serving) {
    if (serving) {
      spdlog::info("frontend is serving: a healthy prefill and decode worker are back");
    } else if (!draining_) {
      spdlog::warn("frontend is NOT_SERVING: no healthy {} worker", !prefill ? "prefill" : "decode");
    }
  }
  serving_ = serving;
  if (health_reporter_) health_reporter_(serving);
}

Status Frontend::health() const {
  if (draining_) return unavailable("this frontend is shutting down");
  if (!any_placeable(registry_->snapshot(WorkerRole::kPrefill))) return unavailable("no healthy prefill worker");
  if (!any_placeable(registry_->snapshot(WorkerRole::kDecode))) return unavailable("no healthy decode worker");
  return {};
}

void Frontend::update_gauges() {
  if (metrics_ == nullptr) return;
  const auto labels = Metrics::role_labels("frontend", context_.name);
  metrics_->queue_depth.Add(labels).Set(scheduler_->n_queued());
  metrics_->running_sequences.Add(labels).Set(scheduler_->n_admitted() - scheduler_->n_queued());
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* Frontend::Generate(grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request) {
  auto* reactor = start_generate_call(context_, context, request);
  update_gauges();
  return reactor;
}

v1::ModelInfo model_info(const ServedModel& m) {
  v1::ModelInfo info;
  model_info_to_proto(m.name, m.config, m.fingerprint, m.chat_template ? m.chat_template->name() : "", &info);
  return info;
}

grpc::ServerUnaryReactor* Frontend::ListModels(grpc::CallbackServerContext* context, const v1::ListModelsRequest*,
                                               v1::ListModelsResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (api_keys_) {
    if (Status st = api_keys_->check(*context); !st.ok()) {
      reactor->Finish(to_grpc(st));
      return reactor;
    }
  }
  *response->add_models() = model_info(model_);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace baton
