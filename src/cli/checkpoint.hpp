// `cmesh checkpoint ls|verify|inspect DIR`: the checkpoints of a root (or
// one step directory) as an operator sees them. Exit codes as the other
// subcommands: 0 all valid, 1 a checkpoint that is not (its typed error on
// stderr), 2 usage, 3 the storage could not be read (I/O).
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace cmesh::cli {

struct checkpoint_args {
  std::string action; // "ls", "verify" or "inspect"
  std::string dir;
};

/// Adds the subcommand to `app`; parsing fills `args`.
CLI::App* add_checkpoint_command(CLI::App& app, checkpoint_args& args);

int run_checkpoint(const checkpoint_args& args);

} // namespace cmesh::cli
