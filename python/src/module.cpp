// module.cpp: zeroplan._zeroplan, the extension under the Python package (zeroplan/__init__.py).
// It parses keyword arguments with zero-plan's own flag definitions (tools/zero-plan/
// zero_plan.hpp) and runs the same code as the command line, so a result is the JSON contract's
// data and an error is the CLI's error. Dicts cross as JSON text; the package turns them back
// into Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "zero_plan.hpp"
#include "zp/error.hpp"
#include "zp/models/model_spec.hpp"

namespace py = pybind11;

namespace {

// One keyword argument as the package passes it: its name and its value already spelled as
// the command line spells it ("7500000000", "1,4,16", "cpu"), or a bool for a switch.
using Kwarg = std::pair<std::string, std::variant<bool, std::string>>;

// Thrown to Python as zeroplan.Error(message, hint); the package adds the field.
struct PyError {
  std::string message, hint;
};

std::vector<std::string> option_names(const CLI::App& sub) {
  std::vector<std::string> names;
  for (const CLI::Option* o : sub.get_options())
    for (const std::string& n : o->get_lnames())
      if (n != "help" && !n.starts_with("no-")) {
        std::string k = n;
        std::replace(k.begin(), k.end(), '-', '_');
        names.push_back(std::move(k));
      }
  return names;
}

// The subcommand's flags for `kwargs`: `name=value` is `--name value`, `name=True` the switch
// `--name`, `name=False` its `--no-name` where it has one (or nothing: the switch's default).
std::vector<std::string> to_args(const CLI::App& sub, const std::string& function,
                                 const std::vector<Kwarg>& kwargs) {
  std::vector<std::string> args;
  for (const auto& [name, value] : kwargs) {
    std::string lname = name;
    std::replace(lname.begin(), lname.end(), '_', '-');
    const CLI::Option* opt = lname.starts_with("no-") || lname == "help"
                                 ? nullptr
                                 : sub.get_option_no_throw("--" + lname);
    if (opt == nullptr || opt->get_lnames().empty()) {
      const auto names = option_names(sub);
      const auto near = zp::models::closest_names(
          name, std::vector<std::string_view>(names.begin(), names.end()), 3);
      throw PyError{fmt::format("{}: not an argument of zeroplan.{}()", name, function),
                    near.empty() ? std::string("see help(zeroplan)")
                                 : fmt::format("closest: {}", fmt::join(near, ", "))};
    }
    const bool is_switch = opt->get_items_expected_max() == 0;  // a flag takes no value
    if (const bool* b = std::get_if<bool>(&value)) {
      if (!is_switch)
        throw PyError{fmt::format("{}: takes a value, not {}", name, *b ? "True" : "False"),
                      fmt::format("e.g. {}=... as zero-plan's --{} takes", name, lname)};
      if (*b)
        args.push_back("--" + lname);
      else if (opt->check_lname("no-" + lname))
        args.push_back("--no-" + lname);
    } else {
      if (is_switch)
        throw PyError{fmt::format("{}: a switch, give True or False", name),
                      fmt::format("e.g. {}=True", name)};
      args.push_back("--" + lname);
      args.push_back(std::get<std::string>(value));
    }
  }
  return args;
}

// Runs `zero-plan <command> <positional...> <kwargs as flags>` in this process and returns
// (exit code, JSON text). Side files (output=, report=, junit=, ...) are written as the CLI
// writes them.
std::pair<int, std::string> run(const std::string& command, const std::string& function,
                                const std::vector<std::string>& positional,
                                const std::vector<Kwarg>& kwargs, const std::string& model_json,
                                const std::string& model_origin, const std::string& ds_json) {
  zp::cli::ZeroPlan z(/*plan_output_required=*/false);
  CLI::App* sub = nullptr;
  for (CLI::App* c : z.app().get_subcommands({}))
    if (c->get_name() == command) sub = c;
  if (sub == nullptr) throw PyError{fmt::format("zero-plan has no command '{}'", command), ""};
  std::vector<std::string> args = {command};
  args.insert(args.end(), positional.begin(), positional.end());
  const auto flags = to_args(*sub, function, kwargs);
  args.insert(args.end(), flags.begin(), flags.end());
  if (!model_json.empty()) z.set_model_json(model_json, model_origin);
  if (!ds_json.empty()) z.set_ds_config(nlohmann::json::parse(ds_json), "strategy");
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector last argument first
  try {
    z.app().parse(args);
  } catch (const CLI::ParseError& e) {
    throw PyError{e.what(), fmt::format("help(zeroplan.{}) lists the arguments", function)};
  }
  zp::cli::Output out;
  {
    py::gil_scoped_release unlocked;  // a fit search may take seconds; Python threads go on
    out = z.execute(zp::reports::Format::json);
  }
  if (!out.path.empty()) zp::cli::emit(out.path, out.text);
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
    } catch (const PyError& e) {
      raise(e.message, e.hint);
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
  m.def("supported_model_types", &zp::models::supported_model_types);
}
