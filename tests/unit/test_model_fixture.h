// The random test model (model/test_model.h) loaded on the CPU backend, for tests that run the
// engine. The default spec has an untied LM head, so logits depend on the KV.
#pragma once

#include <catch2/catch.hpp>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/test_model.h"

namespace baton::testing {

struct LoadedTestModel {
  explicit LoadedTestModel(const TestModelSpec& spec = {}, DType dtype = DType::kF32) {
    std::string err;
    backend = make_backend({"cpu", dtype, 0, {}}, &err);
    REQUIRE(backend);
    auto f = GgufFile::parse(make_test_model(spec).to_bytes());
    REQUIRE(f.ok());
    file = std::move(*f);
    auto m = Model::load(*file, *backend);
    REQUIRE(m.ok());
    model = std::move(*m);
  }
  std::unique_ptr<Backend> backend;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};

}  // namespace baton::testing
