// module.cpp: zeroplan._zeroplan, the extension under the Python package (zeroplan/__init__.py).
// It parses keyword arguments with zero-plan's own flag definitions (tools/zero-plan/
// zero_plan.hpp) and runs the same code as the command line, so a result is the JSON contract's
// data and an error is the CLI's error. Dicts cross as JSON text; the package turns them back
// into Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "zero_plan.hpp"
#include "zp/error.hpp"

namespace py = pybind11;

namespace {

// zero-plan COMMAND with keyword arguments; (exit code, JSON text). Side files (output=,
// report=, junit=, ...) are written as the CLI writes them.
std::pair<int, std::string> run(const std::string& command, const std::string& function,
                                const std::vector<std::string>& positional,
                                const std::vector<zp::cli::Keyword>& kwargs,
                                const std::string& model_json, const std::string& model_origin,
                                const std::string& ds_json) {
  zp::cli::KeywordCall call{command,
                            fmt::format("zeroplan.{}()", function),
                            positional,
                            kwargs,
                            model_json,
                            model_origin,
                            ds_json.empty() ? nlohmann::json() : nlohmann::json::parse(ds_json)};
  py::gil_scoped_release unlocked;  // a fit search may take seconds; Python threads go on
  const zp::cli::Output out = zp::cli::run_keywords(call);
  return {out.code, out.text};
}

}  // namespace

PYBIND11_MODULE(_zeroplan, m) {
  m.doc() = "zeroplan's planner (the C++ libraries behind zero-plan); use the zeroplan package";
  // The package's zeroplan.Error, raised with (message, hint) for every zp::Error and bad
  // argument; RuntimeError until the package has set it. Never freed: it must outlive the
  // interpreter's teardown of this module.
  static auto* error_class = new py::object();
  m.def("_set_error_class", [](py::object cls) { *error_class = std::move(cls); });
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    auto raise = [](const std::string& message, const std::string& hint) {
      PyObject* cls = !*error_class ? PyExc_RuntimeError : error_class->ptr();
      PyErr_SetObject(cls, py::make_tuple(message, hint).ptr());
    };
    try {
      std::rethrow_exception(p);
    } catch (const zp::Error& e) {
      raise(e.what(), e.hint());
    }
  });
  m.def("run", &run, py::arg("command"), py::arg("function"), py::arg("positional"),
        py::arg("kwargs"), py::arg("model_json"), py::arg("model_origin"), py::arg("ds_json"),
        "zero-plan COMMAND with keyword arguments as flags; returns (exit code, JSON text)");
  m.def(
      "main",
      [](const std::vector<std::string>& argv) {
        std::vector<char*> ptrs;
        for (const std::string& a : argv) ptrs.push_back(const_cast<char*>(a.c_str()));
        ptrs.push_back(nullptr);
        py::gil_scoped_release unlocked;
        return zp::cli::zero_plan_main(static_cast<int>(argv.size()), ptrs.data());
      },
      "zero-plan's command line (python3 -m zeroplan)");
}
