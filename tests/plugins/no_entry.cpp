// A shared object that is not an spmdx plugin: no entry point.
extern "C" __attribute__((visibility("default"))) int not_a_plugin() { return 42; }
