// policy_matrix.c compiled as C++.
#include "policy_matrix.c"
