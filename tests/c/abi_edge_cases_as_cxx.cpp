// abi_edge_cases.c compiled as C++.
#include "abi_edge_cases.c"
