/*
 * launch.cu - launch.h's switch.
 */
#include "kernels/launch.h"

static bool pdl_on;

void kern_set_pdl(bool on)
{
    pdl_on = on;
}

bool kern_pdl(void)
{
    return pdl_on;
}
