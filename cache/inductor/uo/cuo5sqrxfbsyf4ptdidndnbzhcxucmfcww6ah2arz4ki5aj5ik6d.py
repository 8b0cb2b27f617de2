# AOT ID: ['0_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


cpp_fused_add_bitwise_and_bitwise_not_bitwise_or_ge_lt_mul_sub_0 = async_compile.cpp_pybinding(['const int32_t*', 'int64_t*', 'bool*', 'const int64_t', 'const int64_t', 'const int64_t', 'const int64_t', 'const int64_t', 'const int64_t'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int32_t* in_ptr0,
                       int64_t* out_ptr0,
                       bool* out_ptr1,
                       const int64_t ks0,
                       const int64_t ks1,
                       const int64_t ks2,
                       const int64_t ks3,
                       const int64_t ks4,
                       const int64_t ks5)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    #pragma omp parallel
    {
        int tid = omp_get_thread_num();
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(8L))
            {
                {
                    if(C10_LIKELY(x0 >= static_cast<int64_t>(0) && x0 < static_cast<int64_t>(8L*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L))))))
                    {
                        auto tmp0 = at::vec::Vectorized<int32_t>::loadu(in_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                        auto tmp1 = ks1;
                        auto tmp2 = c10::convert<int32_t>(tmp1);
                        auto tmp3 = at::vec::Vectorized<int32_t>(tmp2);
                        auto tmp4 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp3);
                        auto tmp5 = ks2;
                        auto tmp6 = c10::convert<int32_t>(tmp5);
                        auto tmp7 = at::vec::Vectorized<int32_t>(tmp6);
                        auto tmp8 = at::vec::VecMask<int32_t,1>(tmp0 < tmp7);
                        auto tmp9 = tmp4.template cast<int32_t,1>();
                        auto tmp10 = tmp8.template cast<int32_t,1>();
                        auto tmp11 = tmp9 & tmp10;
                        auto tmp12 = ks3;
                        auto tmp13 = c10::convert<int32_t>(tmp12);
                        auto tmp14 = at::vec::Vectorized<int32_t>(tmp13);
                        auto tmp15 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp14);
                        auto tmp16 = ks4;
                        auto tmp17 = c10::convert<int32_t>(tmp16);
                        auto tmp18 = at::vec::Vectorized<int32_t>(tmp17);
                        auto tmp19 = at::vec::VecMask<int32_t,1>(tmp0 < tmp18);
                        auto tmp20 = tmp15.template cast<int32_t,1>();
                        auto tmp21 = tmp19.template cast<int32_t,1>();
                        auto tmp22 = tmp20 & tmp21;
                        auto tmp23 = tmp11.template cast<int32_t,1>();
                        auto tmp24 = tmp22.template cast<int32_t,1>();
                        auto tmp25 = tmp23 | tmp24;
                        auto tmp26 = tmp25.to<int64_t,2>();
                        auto tmp27 = at::vec::convert<int64_t,2,int32_t,1>(tmp0);
                        auto tmp28 = tmp11.to<int64_t,2>();
                        auto tmp29 = c10::convert<int64_t>(tmp1);
                        auto tmp30 = at::vec::VectorizedN<int64_t,2>(tmp29);
                        auto tmp31 = tmp28 * tmp30;
                        auto tmp32 = tmp22.to<int64_t,2>();
                        auto tmp33 = ks1 + ks3 + ((-1L)*ks2) + ((-1L)*ks5);
                        auto tmp34 = c10::convert<int64_t>(tmp33);
                        auto tmp35 = at::vec::VectorizedN<int64_t,2>(tmp34);
                        auto tmp36 = tmp32 * tmp35;
                        auto tmp37 = tmp31 + tmp36;
                        auto tmp38 = tmp27 - tmp37;
                        auto tmp39 = tmp26 * tmp38;
                        auto tmp40 = ~tmp25;
                        tmp39.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                        tmp40.store(out_ptr1 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                    }
                    if(C10_UNLIKELY(x0 >= static_cast<int64_t>(8L*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))) && x0 < static_cast<int64_t>(ks0)))
                    {
                        auto tmp0 = at::vec::Vectorized<int32_t>::loadu(in_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                        auto tmp1 = ks1;
                        auto tmp2 = c10::convert<int32_t>(tmp1);
                        auto tmp3 = at::vec::Vectorized<int32_t>(tmp2);
                        auto tmp4 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp3);
                        auto tmp5 = ks2;
                        auto tmp6 = c10::convert<int32_t>(tmp5);
                        auto tmp7 = at::vec::Vectorized<int32_t>(tmp6);
                        auto tmp8 = at::vec::VecMask<int32_t,1>(tmp0 < tmp7);
                        auto tmp9 = tmp4.template cast<int32_t,1>();
                        auto tmp10 = tmp8.template cast<int32_t,1>();
                        auto tmp11 = tmp9 & tmp10;
                        auto tmp12 = ks3;
                        auto tmp13 = c10::convert<int32_t>(tmp12);
                        auto tmp14 = at::vec::Vectorized<int32_t>(tmp13);
                        auto tmp15 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp14);
                        auto tmp16 = ks4;
                        auto tmp17 = c10::convert<int32_t>(tmp16);
                        auto tmp18 = at::vec::Vectorized<int32_t>(tmp17);
                        auto tmp19 = at::vec::VecMask<int32_t,1>(tmp0 < tmp18);
                        auto tmp20 = tmp15.template cast<int32_t,1>();
                        auto tmp21 = tmp19.template cast<int32_t,1>();
                        auto tmp22 = tmp20 & tmp21;
                        auto tmp23 = tmp11.template cast<int32_t,1>();
                        auto tmp24 = tmp22.template cast<int32_t,1>();
                        auto tmp25 = tmp23 | tmp24;
                        auto tmp26 = tmp25.to<int64_t,2>();
                        auto tmp27 = at::vec::convert<int64_t,2,int32_t,1>(tmp0);
                        auto tmp28 = tmp11.to<int64_t,2>();
                        auto tmp29 = c10::convert<int64_t>(tmp1);
                        auto tmp30 = at::vec::VectorizedN<int64_t,2>(tmp29);
                        auto tmp31 = tmp28 * tmp30;
                        auto tmp32 = tmp22.to<int64_t,2>();
                        auto tmp33 = ks1 + ks3 + ((-1L)*ks2) + ((-1L)*ks5);
                        auto tmp34 = c10::convert<int64_t>(tmp33);
                        auto tmp35 = at::vec::VectorizedN<int64_t,2>(tmp34);
                        auto tmp36 = tmp32 * tmp35;
                        auto tmp37 = tmp31 + tmp36;
                        auto tmp38 = tmp27 - tmp37;
                        auto tmp39 = tmp26 * tmp38;
                        auto tmp40 = ~tmp25;
                        tmp39.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                        tmp40.store(out_ptr1 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
''')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1 = args
        args.clear()
        s15 = arg0_1
        s90 = arg2_1
        s87 = arg3_1
        s68 = arg4_1
        s53 = arg5_1
        s88 = arg6_1
        assert_size_stride(arg1_1, (s15, ), (1, ), 'input')
        buf0 = empty_strided_cpu((s15, ), (1, ), torch.int64)
        buf1 = empty_strided_cpu((s15, ), (1, ), torch.bool)
        cpp_fused_add_bitwise_and_bitwise_not_bitwise_or_ge_lt_mul_sub_0(arg1_1, buf0, buf1, s15, s90, s87, s68, s53, s88)
        del arg1_1
        return (buf0, buf1, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = 36
    arg1_1 = rand_strided((36, ), (1, ), device='cpu', dtype=torch.int32)
    arg2_1 = 0
    arg3_1 = 288
    arg4_1 = 576
    arg5_1 = 576
    arg6_1 = 0
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat, device='cpu')


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
