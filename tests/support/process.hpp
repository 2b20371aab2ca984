// process.hpp (tests): run a binary with arguments and capture its exit code, stdout and
// stderr, for CLI tests that judge the tools by what a user would see.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace zp::test {

struct Result {
  int rc = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A weights file of zero-run --save-weights / Engine::save_weights: n_params fp32 values.
inline std::vector<float> read_floats(const std::string& path) {
  const std::string bytes = slurp(path);
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

// ||a - b|| / ||b||, in double.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

// A fresh temporary directory, removed by the destructor.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/zp-test-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(file(name), std::ios::binary) << content;
    return file(name);
  }
};

// The OMPI_* and PMIX_* variables this process started with (name=value), read before main:
// MPI_Init in a test process started without mpirun (a singleton) adds its own (OMPI_MCA_ess,
// PMIX_NAMESPACE, PMIX_SERVER_URI*, ...), and an mpirun that inherits them exits 1 without
// launching anything (Open MPI 4.1).
inline bool is_launcher_var(const char* e) {
  return std::strncmp(e, "OMPI_", 5) == 0 || std::strncmp(e, "PMIX_", 5) == 0;
}
inline const std::set<std::string>& startup_launcher_env() {
  static const std::set<std::string> vars = [] {
    std::set<std::string> v;
    for (char** e = environ; *e != nullptr; ++e)
      if (is_launcher_var(*e)) v.insert(*e);
    return v;
  }();
  return vars;
}
inline const bool kLauncherEnvRead = (startup_launcher_env(), true);

// In a child: drops the launcher variables this process did not start with (see above), so
// a child mpirun or MPI program starts as from a clean shell.
inline void drop_added_launcher_env() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e)
    if (is_launcher_var(*e) && !startup_launcher_env().contains(*e)) {
      const char* eq = std::strchr(*e, '=');
      names.emplace_back(*e, eq != nullptr ? static_cast<std::size_t>(eq - *e) : std::strlen(*e));
    }
  for (const auto& n : names) ::unsetenv(n.c_str());
}

// Starts argv[0] (a path) with the rest as arguments, stdin /dev/null, stdout and stderr to
// the given files, and without the launcher variables an MPI_Init in this process added
// (keep_added_launcher_env: with them, to show why); returns the child's pid.
inline pid_t spawn(const std::vector<std::string>& argv, const std::string& out,
                   const std::string& err, const std::vector<std::string>& env = {},
                   bool keep_added_launcher_env = false) {
  std::fflush(nullptr);  // or the child's freopen writes our pending output a second time
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);  // its own process group, so a timeout can end it and its children
    std::freopen("/dev/null", "r", stdin);
    std::freopen(out.c_str(), "w", stdout);
    std::freopen(err.c_str(), "w", stderr);
    if (!keep_added_launcher_env) drop_added_launcher_env();
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  return pid;
}

// Waits up to `timeout_s` seconds for pid; on timeout kills its process group and returns
// -1 ("hung"). Otherwise the exit code, or 128 + signal.
inline int wait_for(pid_t pid, int timeout_s) {
  for (int i = 0; i < timeout_s * 20; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    ::usleep(50'000);
  }
  ::kill(-pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

// Runs argv[0] (a path) with the rest as arguments; stdin is /dev/null. A run that takes
// longer than timeout_s is killed and reported with rc -1.
inline Result run(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                  int timeout_s = 300, bool keep_added_launcher_env = false) {
  TempDir tmp;
  const std::string out = tmp.file("out"), err = tmp.file("err");
  const pid_t pid = spawn(argv, out, err, env, keep_added_launcher_env);
  Result r;
  r.rc = wait_for(pid, timeout_s);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace zp::test
