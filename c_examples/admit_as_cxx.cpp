// admit.c compiled as C++: the header and the example must build in both languages.
#include "admit.c"
