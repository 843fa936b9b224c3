// copy_engine.c compiled as C++.
#include "copy_engine.c"
