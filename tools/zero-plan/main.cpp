// zero-plan: capacity estimates and plans for ZeRO training. The command line itself lives in
// zero_plan.cpp (shared with the Python module); this is only its entry point.
#include "zero_plan.hpp"

int main(int argc, char** argv) { return zp::cli::zero_plan_main(argc, argv); }
